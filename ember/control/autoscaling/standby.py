"""`EMBER_STANDBY_GO_FILE=F python -m ember.control.autoscaling.standby serve ...`: a replica process
started before it is needed. It imports what `ember serve` needs (torch, the loader, the engine, the
server: about half of a cold start on a CPU machine), waits until the file F exists, then runs `ember
serve ...` in-process. The local provider keeps one waiting per autoscaled model and creates its file
to start a replica; a restart after a crash finds the file and serves at once."""

from __future__ import annotations

import os
import sys
import time

GO_FILE_ENV = "EMBER_STANDBY_GO_FILE"
GO_POLL_S = 0.02


def main() -> int:
    go_file = os.environ[GO_FILE_ENV]
    import uvicorn  # noqa: F401 - the slow imports of `ember serve`, done while nobody waits

    import ember.engine.async_engine  # noqa: F401
    import ember.loader  # noqa: F401
    import ember.server.app  # noqa: F401
    from ember.cli import main as ember_main

    while not os.path.exists(go_file):
        time.sleep(GO_POLL_S)
    return ember_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
