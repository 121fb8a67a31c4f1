"""One real SmolLM2 `ember serve` for the structured-output and tool-call tests (starting one is the slow
part; every test of this folder shares it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess

MODEL_NAME = "tiny"  # ServerProcess serves under this name


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # Without prefix caching: tests compare a streamed answer with the same request's whole one, which must
    # compute the same steps (a cached prompt runs fewer, and with --quantization auto, steps of other sizes may
    # take other kernels and numerics).
    process = ServerProcess(smollm2_gguf_path, tmp_path_factory.mktemp("serve") / "serve.log",
                            "--max-num-seqs", "32", "--kv-cache-memory", "1", "--no-enable-prefix-caching")
    yield process
    process.stop()
