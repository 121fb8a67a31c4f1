"""Replicas as Ray actors: the provider `ember up` uses when its fleet file has a `launch.ray` section.

Each replica is one `ServeProcess` actor, placed by Ray on a node with the replica's CPU/GPU/memory
request free, that runs `ember serve` as a subprocess on a free port of that node's address (with the
fleet's service credential as its API key). The provider registers the replica with the gateway as
soon as its address is known (the gateway admits it at its first passing health probe), stops it by
deregistering it first (the gateway drains it) and then stopping the process and the actor, and every
`launch.ray.health_interval_s` asks each actor whether its process still runs: a replica whose process
exited or whose actor died (its node gone, `ray.kill`) leaves the gateway and is replaced. `resync()`
(each autoscaler round) registers again the ready replicas a restarted gateway no longer knows.

The actors are owned by `ember up`'s Ray driver, not detached: the provider alone registers them with
the gateway and watches them, so when `ember up` ends (or dies) Ray ends them with it instead of
leaving replicas that hold a node's CPUs or GPUs with nobody routing to them. They are named
(`ember-<replica id>` in `launch.ray.namespace`) so that `ray list actors` shows which is which.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx
import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from ember.control.autoscaling.provider import GatewayAdmin, ManagedReplica, ReplicaState, free_port
from ember.control.fleet import AutoscaledModel, Fleet, LaunchRay
from ember.control.supervisor import _describe_exit, _die_with_parent
from ember.gateway.config import FLEET_CREDENTIAL_ENV
from ember.server.settings import API_KEY_ENV

MB = 1 << 20
EXIT_CODE_TIMEOUT_S = 5.0  # an actor busy longer than this (stopping its process) is not called dead


class ServeProcess:
    """A Ray actor: one `ember serve` on a free port of the node Ray placed it on."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self._argv = argv
        self._env = env
        self._process: subprocess.Popen | None = None

    def start(self) -> str:
        """Starts `ember serve`; returns its base URL."""
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self._process = subprocess.Popen(
            [*self._argv, "--host", host, "--port", str(port)],
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self._env},
            start_new_session=True,  # stop() signals its whole process group
            preexec_fn=_die_with_parent,  # the actor killed (ray.kill, its node lost): the server goes too
        )
        return f"http://{host}:{port}"

    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def exit_code(self) -> int | None:
        """None while `ember serve` runs."""
        return None if self._process is None else self._process.poll()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the server finishes its requests), SIGKILL after `timeout_s`; returns the exit code."""
        if self._process is None or self._process.poll() is not None:
            return self.exit_code()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGTERM)
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            return self._process.wait()


ServeActor = ray.remote(ServeProcess)


def connect_driver(settings: LaunchRay) -> None:
    """Connects this process to the Ray cluster as its driver. Blocking, and run in a worker thread:
    there Ray installs no SIGTERM handler of its own, and `ember up`'s supervisor keeps the signals."""
    if settings.address == "local":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a head of our own: report nothing
        ray.init(
            namespace=settings.namespace,
            num_cpus=settings.head.num_cpus,
            num_gpus=settings.head.num_gpus,
            object_store_memory=settings.head.object_store_memory_mb * MB,
            include_dashboard=False,
        )
    else:
        ray.init(address=settings.address, namespace=settings.namespace)


class RayProvider:
    """The autoscaling provider (start / stop with drain / list) on a Ray cluster; see the module doc."""

    def __init__(self, fleet: Fleet, gateway: GatewayAdmin, log=print):
        assert fleet.launch.ray is not None
        self.settings = fleet.launch.ray
        self.models: dict[str, AutoscaledModel] = fleet.autoscaled
        self.credential = fleet.credential
        self.gateway = gateway
        self.log = log
        self._stop_timeout_s = fleet.launch.shutdown_timeout_s
        self._restart = fleet.launch.restart
        self._failed_starts: dict[str, int] = {}  # model -> replicas in a row that died before admission
        self._fleet_tag = secrets.token_hex(3)  # two fleets on one cluster never share an actor name
        self._started = 0
        self._replicas: dict[str, ManagedReplica] = {}
        self._actors: dict[str, ActorHandle] = {}
        self._admissions: dict[str, asyncio.Task] = {}  # replicas not yet admitted by the gateway
        self._watcher: asyncio.Task | None = None

    @classmethod
    async def connect(cls, fleet: Fleet, gateway: GatewayAdmin, log=print) -> RayProvider:
        """Connects to (or with `address: local` starts) the Ray cluster and starts watching replicas."""
        assert fleet.launch.ray is not None
        await asyncio.to_thread(connect_driver, fleet.launch.ray)
        provider = cls(fleet, gateway, log)
        resources = ray.cluster_resources()
        log(f"ray: connected to {fleet.launch.ray.address} ({resources.get('CPU', 0):g} CPUs, "
            f"{resources.get('GPU', 0):g} GPUs)")  # fmt: skip
        provider._watcher = asyncio.create_task(provider._watch(), name="ray-replica-watcher")
        return provider

    # --- the provider interface -----------------------------------------------------------------

    async def start_replica(self, model: str) -> ManagedReplica:
        """Asks Ray for the actor and returns at once: `url` stays empty until Ray has placed it."""
        return self._start(model, delay_s=0.0)

    async def start(self) -> None:
        """Nothing to prepare ahead: Ray starts an actor when a replica is asked for."""

    async def resync(self) -> None:
        """Registers again the ready replicas the gateway does not know (a restarted gateway knows only
        its config); they count as loading until it admits them again."""
        known = await self.gateway.states()
        for replica in self.list_replicas():
            if replica.state == ReplicaState.READY and replica.id not in known:
                self.log(f"ray: {replica.id} is unknown to the gateway (restarted?): registering it again")
                replica.state = ReplicaState.LOADING
                self._admissions[replica.id] = asyncio.create_task(self._register(replica), name=f"admit-{replica.id}")

    async def stop_replica(self, replica_id: str) -> None:
        """Out of the gateway first (its requests finish there), then the process and the actor."""
        await self._retire(replica_id, drain=True)

    def list_replicas(self, model: str | None = None) -> list[ManagedReplica]:
        return [replica for replica in self._replicas.values() if model is None or replica.model == model]

    async def close(self) -> None:
        """Drains and stops every replica, then disconnects from Ray (which stops a local head)."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await asyncio.gather(*(self._retire(replica_id, drain=True) for replica_id in list(self._replicas)),
                             return_exceptions=True)  # fmt: skip
        await self.gateway.close()
        await asyncio.to_thread(ray.shutdown)

    # --- one replica's life -----------------------------------------------------------------------

    def _start(self, model: str, delay_s: float) -> ManagedReplica:
        """A new replica, listed as loading at once (so that nobody starts another in its place); its
        actor is asked for after `delay_s`."""
        self._started += 1
        replica = ManagedReplica(
            id=f"{model}-ray-{self._fleet_tag}-{self._started}", model=model, url="", state=ReplicaState.LOADING,
            started_at=time.monotonic(),
        )  # fmt: skip
        self._replicas[replica.id] = replica
        self._admissions[replica.id] = asyncio.create_task(self._admit(replica, delay_s), name=f"admit-{replica.id}")
        return replica

    async def _admit(self, replica: ManagedReplica, delay_s: float) -> None:
        """Creates the actor, starts `ember serve` in it, registers it: done once the gateway admits it."""
        await asyncio.sleep(delay_s)
        how = self.models[replica.model]
        request = self.settings.replica
        options = {"num_cpus": request.num_cpus, "num_gpus": request.num_gpus}
        if request.memory_mb is not None:
            options["memory"] = request.memory_mb * MB
        actor = ServeActor.options(name=f"ember-{replica.id}", namespace=self.settings.namespace, **options)
        argv = [sys.executable, "-m", "ember.cli", *how.serve_args]  # the nodes run ember where this one does
        self._actors[replica.id] = actor.remote(argv, {API_KEY_ENV: self.credential})
        replica.url = await self._actors[replica.id].start.remote()  # once Ray has placed the actor
        self.log(f"ray: {replica.id} runs ember serve at {replica.url}")
        await self._register(replica)

    async def _register(self, replica: ManagedReplica) -> None:
        """Has the gateway admit the replica (it requires the fleet credential), then marks it ready."""
        how = self.models[replica.model]
        await self.gateway.admit(replica, how.capacity, how.region, api_key_env=FLEET_CREDENTIAL_ENV)
        del self._admissions[replica.id]
        self._failed_starts.pop(replica.model, None)
        replica.state = ReplicaState.READY
        if replica.ready_at is None:  # not a re-registration: its cold start ends here
            replica.ready_at = time.monotonic()
            self.log(f"ray: {replica.id} admitted by the gateway {replica.cold_start_s:.1f}s after its start")
        else:
            self.log(f"ray: {replica.id} admitted again by the gateway")

    async def _retire(self, replica_id: str, drain: bool) -> None:
        replica = self._replicas[replica_id]
        replica.state = ReplicaState.DRAINING
        admission = self._admissions.pop(replica_id, None)
        if admission is not None:
            admission.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError, RayActorError):
                await admission
        actor = self._actors.pop(replica_id, None)  # None: its start was still waiting out a backoff
        try:
            if drain:
                await self.gateway.deregister(replica_id)
            else:  # its process is gone: nothing to drain, out of routing at once
                with contextlib.suppress(httpx.HTTPError):
                    await self.gateway.deregister(replica_id, timeout_s=0)
        finally:
            del self._replicas[replica_id]
            if actor is not None:
                if replica.url:  # an actor Ray has not placed yet has no process to stop (and would not answer)
                    with contextlib.suppress(RayActorError):
                        await actor.stop.remote(self._stop_timeout_s)
                ray.kill(actor)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            for replica in [r for r in self._replicas.values() if r.state != ReplicaState.DRAINING]:
                try:
                    why = await self._death(replica)
                    if why is not None and replica.id in self._replicas:
                        await self._retire(replica.id, drain=False)
                        self._replace(replica, why)
                except Exception as exc:  # noqa: BLE001 - one bad round must not end the watching
                    self.log(f"ray: checking {replica.id} failed: {exc!r}")

    def _replace(self, dead: ManagedReplica, why: str) -> None:
        """A new replica in place of the dead one: at once if the dead one had served, else after the
        fleet's restart backoff (doubling for each replica in a row that died before admission), so a
        model that cannot load does not have Ray start actors in a tight loop."""
        delay_s = 0.0
        if dead.ready_at is None:
            failed = self._failed_starts[dead.model] = self._failed_starts.get(dead.model, 0) + 1
            delay_s = min(self._restart.max_backoff_s, self._restart.initial_backoff_s * 2 ** (failed - 1))
        replacement = self._start(dead.model, delay_s)
        self.log(f"ray: {dead.id} {why}; replaced by {replacement.id}" + (f" in {delay_s:g}s" if delay_s else ""))

    async def _death(self, replica: ManagedReplica) -> str | None:
        """Why the replica is dead, or None while it lives (or is still being placed or busy)."""
        admission = self._admissions.get(replica.id)
        if not replica.url:
            if admission is not None and admission.done() and admission.exception() is not None:
                return f"never started ember serve ({admission.exception()})"
            return None
        try:
            code = await asyncio.wait_for(self._actors[replica.id].exit_code.remote(), EXIT_CODE_TIMEOUT_S)
        except TimeoutError:
            return None
        except RayActorError as exc:
            return f"lost its actor ({type(exc).__name__})"
        return None if code is None else f"ember serve exited ({_describe_exit(code)})"
