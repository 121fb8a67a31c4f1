"""Runs a fleet's processes (the gateway and its local replicas) until SIGTERM/SIGINT.

- Each child runs in its own session (process group): a terminal's Ctrl-C reaches only the
  supervisor, which then stops the children in order (gateway first, so it stops taking requests
  while the replicas still finish the ones it forwarded, then the replicas together), each with
  SIGTERM to its group and SIGKILL after `shutdown_timeout_s`. A second signal skips the wait.
- On Linux each child also gets SIGTERM if the supervisor itself dies, so none is orphaned.
- A child that exits on its own is restarted after an exponential backoff (initial_backoff_s,
  doubling up to max_backoff_s), reset once a run has lasted stable_after_s.
- Child output is copied line by line to stdout, prefixed with the child's name; readiness
  (its /health answering 200) is reported once per start.
- Children can join and leave while it runs (`add_child`, `remove_child`: the autoscaler's
  replicas), and services (the autoscaler) run alongside: started once the children are, stopped
  first on shutdown so that nothing starts replicas while the fleet stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from ember.control.fleet import ChildSpec, Fleet, RestartPolicy
from ember.side_client import side_client

PR_SET_PDEATHSIG = 1
READY_POLL_S = 0.5
READY_PROBE_TIMEOUT_S = 2.0
OUTPUT_LINE_LIMIT = 1 << 20


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class _Child:
    spec: ChildSpec
    process: asyncio.subprocess.Process | None = None
    starts: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)
    retired: bool = False  # removed on purpose: stopped, not restarted


class Supervisor:
    def __init__(self, fleet: Fleet, out=None, services: Sequence[Service] = ()):
        self.fleet = fleet
        self.restart: RestartPolicy = fleet.launch.restart
        self.shutdown_timeout_s = fleet.launch.shutdown_timeout_s
        self._out = out or sys.stdout
        self._children = [_Child(spec) for spec in fleet.children]
        self.services = list(services)
        self._stopping = asyncio.Event()
        self._force = asyncio.Event()
        self._ready: set[str] = set()  # children that answered /health at least once
        self._fleet_children = {spec.name for spec in fleet.children}  # "fleet ready" waits for these
        self._announced = False

    def log(self, message: str) -> None:
        self._out.write(f"[ember up] {message}\n")
        self._out.flush()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        self.log(f"starting {len(self._children) - 1} replica(s) and the gateway on {self.fleet.gateway_url}")
        async with side_client(READY_PROBE_TIMEOUT_S) as probe:
            self._probe = probe
            for child in self._children:
                child.task = asyncio.create_task(self._supervise(child), name=child.spec.name)
            for service in self.services:
                await service.start()
            await self._stopping.wait()
            for service in self.services:
                await service.stop()
            self.log("stopping: gateway first, then the replicas")
            gateway, *replicas = self._children
            await self._stop_child(gateway)
            await asyncio.gather(*(self._stop_child(child) for child in replicas))
            await asyncio.gather(*(child.task for child in self._children if child.task is not None))
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        self.log("all processes stopped")
        return 0

    def add_child(self, spec: ChildSpec) -> None:
        """Starts and supervises one more process (call while `run` runs)."""
        child = _Child(spec)
        self._children.append(child)
        child.task = asyncio.create_task(self._supervise(child), name=spec.name)

    async def remove_child(self, name: str) -> None:
        """Stops a process for good (SIGTERM, SIGKILL after shutdown_timeout_s) and forgets it."""
        child = next((child for child in self._children if child.spec.name == name), None)
        if child is None:
            return
        child.retired = True
        await self._stop_child(child)
        if child.task is not None:
            await child.task
        self._children.remove(child)
        self._ready.discard(name)

    def request_stop(self) -> None:
        if self._stopping.is_set():
            self._force.set()  # a second signal: do not wait for graceful exits
        self._stopping.set()

    async def _supervise(self, child: _Child) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.restart.initial_backoff_s
        while not self._stopping.is_set() and not child.retired:
            started = loop.time()
            try:
                child.process = await asyncio.create_subprocess_exec(
                    *child.spec.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **child.spec.env},
                    limit=OUTPUT_LINE_LIMIT,
                )
            except OSError as exc:
                self.log(f"{child.spec.name} could not start: {exc}")
                returncode = None
            else:
                # A stop that came while it was being spawned found no process to signal: stop it now.
                stopped = self._stopping.is_set() or child.retired
                late_stop = asyncio.create_task(self._stop_child(child)) if stopped else None
                child.starts += 1
                self.log(f"{child.spec.name} started (pid {child.process.pid}): ember {shlex.join(child.spec.argv[3:])}")
                ready = asyncio.create_task(self._report_ready(child, child.process))
                await self._copy_output(child, child.process)
                returncode = await child.process.wait()
                ready.cancel()
                if late_stop is not None:
                    await late_stop
            if self._stopping.is_set() or child.retired:
                break
            uptime = loop.time() - started
            if uptime >= self.restart.stable_after_s:
                backoff = self.restart.initial_backoff_s
            exited = "could not start" if returncode is None else f"exited with {_describe_exit(returncode)}"
            self.log(f"{child.spec.name} {exited} after {uptime:.1f}s; restarting in {backoff:g}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, self.restart.max_backoff_s)

    async def _copy_output(self, child: _Child, process: asyncio.subprocess.Process) -> None:
        prefix = f"[{child.spec.name}] "
        assert process.stdout is not None
        while True:
            try:
                line = await process.stdout.readline()
            except ValueError:  # a line beyond the reader's limit: pass it on in pieces
                line = await process.stdout.read(OUTPUT_LINE_LIMIT)
            if not line:
                return
            self._out.write(prefix + line.decode(errors="replace").rstrip("\n") + "\n")
            self._out.flush()

    async def _report_ready(self, child: _Child, process: asyncio.subprocess.Process) -> None:
        while process.returncode is None:
            with contextlib.suppress(httpx.HTTPError):
                if (await self._probe.get(child.spec.health_url)).status_code == 200:
                    self.log(f"{child.spec.name} ready ({child.spec.health_url})")
                    self._ready.add(child.spec.name)
                    if self._fleet_children <= self._ready and not self._announced:
                        self._announced = True
                        self.log(f"fleet ready: send requests to {self.fleet.gateway_url}/v1")
                    return
            await asyncio.sleep(READY_POLL_S)

    async def _stop_child(self, child: _Child) -> None:
        process = child.process
        if process is None or process.returncode is not None:
            return
        self._signal_group(process, signal.SIGTERM)
        waiting = asyncio.ensure_future(process.wait())
        forced = asyncio.ensure_future(self._force.wait())
        await asyncio.wait({waiting, forced}, timeout=self.shutdown_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if process.returncode is None:
            why = "a second signal" if self._force.is_set() else f"not stopped after {self.shutdown_timeout_s:g}s"
            self.log(f"{child.spec.name}: {why}, killing it")
            self._signal_group(process, signal.SIGKILL)
        await waiting

    @staticmethod
    def _signal_group(process: asyncio.subprocess.Process, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
