"""The supervisor's restart backoff and shutdown escalation, on tiny Python children (no model)."""

from __future__ import annotations

import asyncio
import io
import re
import sys
from pathlib import Path

from ember.control.fleet import ChildSpec, Fleet, LaunchConfig, RestartPolicy
from ember.control.supervisor import Supervisor
from ember.gateway.config import parse_config

CRASHER = "import sys; print('boom', flush=True); sys.exit(3)"
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
)


async def wait_until(condition, limit_s: float = 120.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), limit_s)


async def test_crashing_child_restarts_with_doubling_backoff_and_a_stubborn_one_is_killed(tmp_path: Path):
    nowhere = "http://127.0.0.1:9/health"  # readiness is only logged; nothing listens here
    children = [
        ChildSpec("stubborn", [sys.executable, "-c", STUBBORN], nowhere),
        ChildSpec("crasher", [sys.executable, "-c", CRASHER], nowhere),
    ]
    launch = LaunchConfig(
        restart=RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, stable_after_s=60), shutdown_timeout_s=1
    )
    gateway = parse_config({"models": {"m": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:9"}]}]}}})
    out = io.StringIO()
    supervisor = Supervisor(Fleet(tmp_path / "fleet.yaml", gateway, launch, children), out=out)
    running = asyncio.create_task(supervisor.run())
    await wait_until(lambda: out.getvalue().count("crasher exited with code 3") >= 5 and "[stubborn] up" in out.getvalue())
    supervisor.request_stop()
    assert await asyncio.wait_for(running, 60) == 0

    text = out.getvalue()
    backoffs = re.findall(r"crasher exited with code 3 after [\d.]+s; restarting in ([\d.]+)s", text)
    assert backoffs[:5] == ["0.05", "0.1", "0.2", "0.2", "0.2"]
    assert text.count("[crasher] boom") >= 5
    assert "[ember up] stubborn: not stopped after 1s, killing it" in text
    assert text.rstrip().endswith("[ember up] all processes stopped")
    stubborn_pid = int(re.search(r"stubborn started \(pid (\d+)\)", text).group(1))
    assert not Path(f"/proc/{stubborn_pid}").exists()


SLEEPER = "import time, os; print('up', os.environ['EMBER_TEST_MARK'], flush=True); time.sleep(600)"


class Recorder:
    """A supervisor service: records when it is started and stopped, relative to the children."""

    def __init__(self, out: io.StringIO):
        self.out = out

    async def start(self) -> None:
        self.out.write("service started\n")

    async def stop(self) -> None:
        self.out.write("service stopped\n")


async def test_children_join_and_leave_while_it_runs_and_services_stop_before_the_children(tmp_path: Path):
    nowhere = "http://127.0.0.1:9/health"
    launch = LaunchConfig(shutdown_timeout_s=5)
    gateway = parse_config({"models": {"m": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:9"}]}]}}})
    out = io.StringIO()
    fleet = Fleet(tmp_path / "fleet.yaml", gateway, launch, [ChildSpec("base", [sys.executable, "-c", SLEEPER], nowhere,
                                                                        {"EMBER_TEST_MARK": "base"})])  # fmt: skip
    supervisor = Supervisor(fleet, out=out, services=[Recorder(out)])
    running = asyncio.create_task(supervisor.run())
    await wait_until(lambda: "[base] up base" in out.getvalue() and "service started" in out.getvalue())
    supervisor.add_child(ChildSpec("extra", [sys.executable, "-c", SLEEPER], nowhere, {"EMBER_TEST_MARK": "extra"}))
    await wait_until(lambda: "[extra] up extra" in out.getvalue())
    extra_pid = int(re.search(r"extra started \(pid (\d+)\)", out.getvalue()).group(1))
    await supervisor.remove_child("extra")  # stopped for good: not restarted
    assert not Path(f"/proc/{extra_pid}").exists()
    await asyncio.sleep(0.5)
    assert out.getvalue().count("extra started") == 1 and "restarting" not in out.getvalue()
    supervisor.request_stop()
    assert await asyncio.wait_for(running, 60) == 0
    text = out.getvalue()
    assert text.index("service stopped") < text.index("stopping: gateway first, then the replicas")
