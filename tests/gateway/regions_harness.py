"""Regions for the front-door tests and benchmark (import it as `regions_harness`): each cluster in
its own Linux network namespace, joined to the root namespace by a veth pair in a private /24 this
harness makes, and inter-region latency added by a delaying TCP relay (the kernel here has no netem
qdisc to delay packets). Where namespaces cannot be made (not root, no `ip`), every region is the
loopback interface and the relay alone makes the distance.

    network = RegionNetwork()              # namespaces if it can, else loopback
    east = network.add_region("east")      # east.address: where its processes listen
    relay = DelayRelay(east.address, port, delay_s=0.02).start()   # relay.url: east, 20 ms away each way
    ...
    relay.stop(); network.close()          # removes the namespaces and veth pairs it made
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import yaml
from gateway_harness import GatewayProcess, free_port, sha256


class DelayRelay:
    """A TCP relay on 127.0.0.1 that forwards each direction's bytes `delay_s` after they arrived, in
    order, and passes a close on the same way (a half-close as a half-close; a reset, or a target that
    refuses the connection, as a reset). Runs on its own event loop thread."""

    def __init__(self, target_host: str, target_port: int, delay_s: float):
        self.target_host = target_host
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    def start(self) -> DelayRelay:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", self.port), self._loop
        ).result(timeout=10)
        return self

    def stop(self) -> None:
        async def shut() -> None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await asyncio.sleep(self.delay_s)  # the SYN's trip to the far region
            try:
                target_reader, target_writer = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError:
                await asyncio.sleep(self.delay_s)  # the refusal's trip back
                client_writer.transport.abort()
                return
            await asyncio.gather(
                self._pipe(client_reader, target_writer), self._pipe(target_reader, client_writer)
            )
            client_writer.close()
            target_writer.close()
        finally:
            self._connections.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: a reader task stamps each chunk with its arrival, this task delivers it at
        arrival + delay. b"" is a clean end of stream, None a reset."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(65536)
                except OSError:
                    data = None
                await queue.put((loop.time() + self.delay_s, data))
                if not data:
                    return

        reading = asyncio.create_task(read())
        try:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(due - loop.time(), 0.0))
                if data is None:
                    writer.transport.abort()
                    return
                if not data:
                    if writer.can_write_eof() and not writer.is_closing():
                        try:
                            writer.write_eof()
                        except OSError:  # the other side is gone already: nothing left to tell it
                            pass
                    return
                writer.write(data)
                try:
                    await writer.drain()
                except OSError:
                    return
        finally:
            reading.cancel()


@dataclass
class Region:
    """Where one cluster's processes run: `prefix` runs a command there, `address` is where they listen
    (and where the root namespace reaches them)."""

    name: str
    address: str
    prefix: list[str] = field(default_factory=list)
    netns: str | None = None
    link: str | None = None  # the root namespace's end of its veth pair


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(("netns", "exec", netns, "ip") if netns else ()), *args]
    subprocess.run(command, check=True, capture_output=True)


class RegionNetwork:
    """Regions as network namespaces (root), else as loopback. `isolated` says which."""

    def __init__(self) -> None:
        self.isolated = os.geteuid() == 0 and shutil.which("ip") is not None
        self._tag = os.getpid() % 100000  # interface names are at most 15 characters
        self._namespaces: list[str] = []
        self._host_links: list[str] = []
        self.regions: list[Region] = []

    def add_region(self, name: str) -> Region:
        if not self.isolated:
            region = Region(name, "127.0.0.1")
        else:
            try:
                region = self._namespace(name)
            except (subprocess.CalledProcessError, OSError):
                self.close()  # whatever this attempt made, then loopback for every region
                self.isolated = False
                return self.add_region(name)
        self.regions.append(region)
        return region

    def _namespace(self, name: str) -> Region:
        index = len(self._namespaces)
        netns = f"ember-{self._tag}-{index}"
        host_link, inner_link = f"em{self._tag}h{index}", f"em{self._tag}n{index}"
        subnet = self._free_subnet()
        host_address, inner_address = str(subnet[1]), str(subnet[2])
        _ip("netns", "add", netns)
        self._namespaces.append(netns)
        _ip("link", "add", host_link, "type", "veth", "peer", "name", inner_link)
        self._host_links.append(host_link)
        _ip("link", "set", inner_link, "netns", netns)
        _ip("addr", "add", f"{host_address}/24", "dev", host_link)
        _ip("link", "set", host_link, "up")
        _ip("addr", "add", f"{inner_address}/24", "dev", inner_link, netns=netns)
        _ip("link", "set", inner_link, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        return Region(name, inner_address, ["ip", "netns", "exec", netns], netns, host_link)

    def partition(self, region: Region) -> None:
        """Cut the region off without a word: its veth link down, so packets to it go nowhere and
        connections to it neither close nor reset (namespaces only)."""
        _ip("link", "set", region.link, "down")

    def heal(self, region: Region) -> None:
        _ip("link", "set", region.link, "up")

    def _free_subnet(self) -> ipaddress.IPv4Network:
        """A 10.x.y.0/24 no interface of the root namespace is on (other tests may hold some)."""
        used = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"], check=True, capture_output=True, text=True
        ).stdout
        for offset in range(256):
            second, third = (
                200 + (self._tag + offset) % 50,
                (self._tag // 50 + len(self._namespaces) + offset) % 256,
            )
            subnet = ipaddress.IPv4Network(f"10.{second}.{third}.0/24")
            if f" 10.{second}.{third}." not in used:
                return subnet
        raise OSError("no free 10.x.y.0/24 for a region")

    def close(self) -> None:
        for link in self._host_links:  # deleting one end of a veth pair deletes both
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for netns in self._namespaces:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._host_links.clear()
        self._namespaces.clear()


class ReplicaProcess(Protocol):
    """A replica process at a fixed URL (EmberServe, or a benchmark's stub): restartable after a kill."""

    url: str

    def start(self) -> ReplicaProcess: ...

    def kill(self) -> None: ...


class Cluster:
    """A cluster in a region: its replica and the `ember gateway` in front of it (a key for the front
    door's service credential, nothing else), reached from the root namespace through a DelayRelay
    that puts the region `delay_s` away each way. `kill()` SIGKILLs both processes (the relay stays,
    as the network would); `start()` brings them back at the same addresses."""

    def __init__(
        self,
        region: Region,
        replica: ReplicaProcess,
        workdir: Path,
        delay_s: float,
        replica_capacity: int = 4,
        model: str = "tiny",
    ):
        self.region = region
        self.replica = replica
        self.service_key = f"sk-{region.name}-service"
        self.workdir = workdir
        self.port = free_port()
        self.gateway: GatewayProcess | None = None
        self.config_path = workdir / f"{region.name}-gateway.yaml"
        config = {
            "models": {
                model: {"deployments": [{"replicas": [{"url": replica.url, "capacity": replica_capacity}]}]}
            },
            "keys": {"inline": [{"name": "front-door", "sha256": sha256(self.service_key)}]},
            "health": {"interval_s": 0.25, "timeout_s": 1.0, "unhealthy_threshold": 2},
            "async": {"store": f"{region.name}-jobs.db"},  # each gateway its own (beside its config file)
        }
        self.config_path.write_text(yaml.safe_dump(config))
        self.relay = DelayRelay(region.address, self.port, delay_s).start()

    def start(self) -> Cluster:
        self.replica.start()
        self.gateway = GatewayProcess(
            self.config_path,
            self.workdir / f"{self.region.name}-gateway.log",
            host=self.region.address,
            port=self.port,
            grpc=False,
            prefix=self.region.prefix,
        )
        return self

    def kill(self) -> None:
        self.gateway.kill()
        self.replica.kill()

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.replica.kill()
        self.relay.stop()

    def member(self, region_name: str, capacity: int) -> dict:
        """This cluster as a front door's `clusters.members` entry (reached through the relay)."""
        return {
            "url": self.relay.url,
            "region": region_name,
            "capacity": capacity,
            "api_key": self.service_key,
        }
