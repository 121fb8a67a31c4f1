"""Providers carry scaling decisions out, behind one small interface:

    replica = await provider.start_replica("tiny")    # returns at once, state "loading"
    await provider.stop_replica(replica.id)           # drains it out of the gateway, then stops it
    provider.list_replicas("tiny")                    # every replica it runs, with its state

A replica is `loading` from its start until the gateway has admitted it (its first successful
probe), `ready` while the gateway routes to it, `draining` from its stop until its process exits.
`LocalProcessProvider` runs `ember serve` processes on free local ports under `ember up`'s
supervisor; Kubernetes or Ray providers implement the same protocol.

To shorten cold starts, the local provider keeps one standby process per autoscaled model (while the
model is below max_replicas): `ember serve`'s imports done, its port chosen, waiting for its go file
(ember.control.autoscaling.standby). Starting a replica creates that file and spawns the next standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import httpx

from ember.control.autoscaling.standby import GO_FILE_ENV
from ember.control.fleet import AutoscaledModel, ChildSpec
from ember.control.supervisor import Supervisor
from ember.gateway.config import FLEET_CREDENTIAL_ENV
from ember.server.settings import API_KEY_ENV

ADMIT_POLL_S = 0.2


class ReplicaState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass
class ManagedReplica:
    id: str
    model: str
    url: str
    state: ReplicaState
    started_at: float  # time.monotonic()
    ready_at: float | None = None

    @property
    def cold_start_s(self) -> float | None:
        """Process start to admission by the gateway."""
        return None if self.ready_at is None else self.ready_at - self.started_at


class ReplicaProvider(Protocol):
    async def start(self) -> None: ...

    async def resync(self) -> None: ...  # each round, before the replicas are counted

    async def start_replica(self, model: str) -> ManagedReplica: ...

    async def stop_replica(self, replica_id: str) -> None: ...

    def list_replicas(self, model: str | None = None) -> list[ManagedReplica]: ...

    async def close(self) -> None: ...


class GatewayAdmin:
    """The gateway's /admin/replicas and /admin/autoscaler, called with the control token `ember up` gave
    the gateway."""

    def __init__(self, gateway_url: str, control_token: str, drain_timeout_s: float):
        self.drain_timeout_s = drain_timeout_s
        self._client = httpx.AsyncClient(
            base_url=gateway_url, headers={"authorization": f"Bearer {control_token}"}, timeout=10.0
        )

    async def register(
        self, replica: ManagedReplica, capacity: int, region: str | None, api_key_env: str | None = None
    ) -> bool:
        """Registers the replica; True once the gateway has admitted it. `api_key_env`: the variable of
        the gateway's environment that holds the key the replica requires."""
        body = {"model": replica.model, "url": replica.url, "id": replica.id, "capacity": capacity, "region": region,
                "api_key_env": api_key_env}  # fmt: skip
        response = await self._client.post("/admin/replicas", json=body)
        response.raise_for_status()
        return response.json()["state"] == "ready"

    async def admit(
        self, replica: ManagedReplica, capacity: int, region: str | None, api_key_env: str | None = None
    ) -> None:
        """Registers the replica and returns once the gateway has admitted it (its first passing probe)."""
        admitted = False
        with contextlib.suppress(httpx.HTTPError):  # a gateway restarting: the loop below asks again
            admitted = await self.register(replica, capacity, region, api_key_env)
        while not admitted:
            await asyncio.sleep(ADMIT_POLL_S)
            with contextlib.suppress(httpx.HTTPError):
                admitted = await self.is_admitted(replica.id)

    async def states(self) -> dict[str, str]:
        """Replica id -> its state in the gateway (loading, ready, ejected, draining)."""
        response = await self._client.get("/admin/replicas")
        response.raise_for_status()
        return {item["id"]: item["state"] for item in response.json()["data"]}

    async def is_admitted(self, replica_id: str) -> bool:
        return (await self.states()).get(replica_id) == "ready"

    async def deregister(self, replica_id: str, timeout_s: float | None = None) -> None:
        """Out of routing at once; returns when its requests have finished (or the drain timed out
        after `timeout_s`, default `drain_timeout_s`)."""
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        response = await self._client.delete(
            f"/admin/replicas/{replica_id}", params={"timeout_s": timeout_s}, timeout=timeout_s + 10.0
        )
        if response.status_code != 404:  # 404: it never got registered
            response.raise_for_status()

    async def report_autoscaler(self, status: dict) -> None:
        """Hands the gateway the autoscaler's status (Autoscaler.status()), which its console shows."""
        response = await self._client.put("/admin/autoscaler", json=status)
        response.raise_for_status()

    async def close(self) -> None:
        await self._client.aclose()


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class _Standby:
    port: int
    process_name: str  # the supervisor's child name
    go_file: Path


class LocalProcessProvider:
    """`ember serve` processes on free local ports, supervised (restarted if they crash) by `ember up`."""

    def __init__(
        self,
        supervisor: Supervisor,
        models: dict[str, AutoscaledModel],
        gateway: GatewayAdmin,
        log: Callable[[str], None] = print,
        credential: str | None = None,
    ):
        """`credential`: the fleet's service credential; the replicas then require it, and the gateway
        (which holds it in FLEET_CREDENTIAL_ENV) sends it to them."""
        self.supervisor = supervisor
        self.credential = credential
        self.models = models
        self.gateway = gateway
        self.log = log
        self._replicas: dict[str, ManagedReplica] = {}
        self._admissions: dict[str, asyncio.Task] = {}  # replicas still loading
        self._process_names: dict[str, str] = {}  # replica id -> the supervisor's child name
        self._standbys: dict[str, _Standby] = {}  # model -> its process waiting to serve
        self._go_files = tempfile.TemporaryDirectory(prefix="ember-standby-")
        self._probe = httpx.AsyncClient(timeout=2.0)

    async def start(self) -> None:
        for model in self.models:
            self._spawn_standby(model)

    def _spawn_standby(self, model: str) -> None:
        how = self.models[model]
        port = free_port(how.host)
        standby = _Standby(port, f"replica-{port}", Path(self._go_files.name) / f"{port}.go")
        argv = [sys.executable, "-m", "ember.control.autoscaling.standby", *how.serve_args,
                "--host", how.host, "--port", str(port)]  # fmt: skip
        health_url = f"http://{how.host}:{port}/health"
        env = {GO_FILE_ENV: str(standby.go_file)}
        if self.credential is not None:
            env[API_KEY_ENV] = self.credential  # in the environment, never in argv (`ps` shows argv)
        self.supervisor.add_child(ChildSpec(standby.process_name, argv, health_url, env))
        self._standbys[model] = standby

    async def start_replica(self, model: str) -> ManagedReplica:
        how = self.models[model]
        standby = self._standbys.pop(model, None)
        if standby is None:  # none waiting (all were used): one that starts at once
            self._spawn_standby(model)
            standby = self._standbys.pop(model)
        standby.go_file.touch()
        replica = ManagedReplica(
            id=f"{model}-{standby.port}", model=model, url=f"http://{how.host}:{standby.port}",
            state=ReplicaState.LOADING, started_at=time.monotonic(),
        )  # fmt: skip
        self._replicas[replica.id] = replica
        self._process_names[replica.id] = standby.process_name
        self._admissions[replica.id] = asyncio.create_task(self._admit(replica, how), name=f"admit-{replica.id}")
        if len(self.list_replicas(model)) < how.autoscaling.max_replicas:
            self._spawn_standby(model)
        return replica

    async def _admit(self, replica: ManagedReplica, how: AutoscaledModel) -> None:
        """Waits for the process to serve, registers it, and marks it ready once the gateway admits it."""
        while not await self._healthy(replica.url + "/health"):
            await asyncio.sleep(ADMIT_POLL_S)
        api_key_env = FLEET_CREDENTIAL_ENV if self.credential is not None else None
        await self.gateway.admit(replica, how.capacity, how.region, api_key_env=api_key_env)
        del self._admissions[replica.id]
        replica.state = ReplicaState.READY
        if replica.ready_at is None:
            replica.ready_at = time.monotonic()
            self.log(f"{replica.id} admitted by the gateway {replica.cold_start_s:.1f}s after its start")
        else:
            self.log(f"{replica.id} admitted by the gateway again")

    async def _healthy(self, url: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return (await self._probe.get(url)).status_code == 200
        return False

    async def stop_replica(self, replica_id: str) -> None:
        replica = self._replicas[replica_id]
        replica.state = ReplicaState.DRAINING
        admission = self._admissions.pop(replica_id, None)
        if admission is not None:
            admission.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await admission
        try:
            await self.gateway.deregister(replica_id)
        finally:
            await self.supervisor.remove_child(self._process_names.pop(replica_id))
            del self._replicas[replica_id]
            if replica.model not in self._standbys:  # below max_replicas again: ready the next start
                self._spawn_standby(replica.model)

    def list_replicas(self, model: str | None = None) -> list[ManagedReplica]:
        return [replica for replica in self._replicas.values() if model is None or replica.model == model]

    async def resync(self) -> None:
        """Registers again the ready replicas the gateway does not know (a gateway restarted by the
        supervisor knows only its config); they count as loading until it admits them again."""
        known = await self.gateway.states()
        for replica in self.list_replicas():
            if replica.state == ReplicaState.READY and replica.id not in known:
                self.log(f"{replica.id} is unknown to the gateway (restarted?): registering it again")
                replica.state = ReplicaState.LOADING
                how = self.models[replica.model]
                self._admissions[replica.id] = asyncio.create_task(self._admit(replica, how), name=f"admit-{replica.id}")

    async def close(self) -> None:
        """Stops admitting; the supervisor stops the processes themselves with the rest of the fleet."""
        for task in self._admissions.values():
            task.cancel()
        await asyncio.gather(*self._admissions.values(), return_exceptions=True)
        await self._probe.aclose()
        await self.gateway.close()
        self._go_files.cleanup()
