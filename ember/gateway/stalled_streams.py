"""Streams left on a replica that went silent: ended with an error event instead of waiting out
`timeouts.read_s`.

A replica (or a front door's cluster) that dies outright resets its connections, and its streams end
at once. One that is cut off without a reset (a network partition, a hung host) leaves its streams
waiting for the next chunk for up to `timeouts.read_s` (120 s by default) while its health probes are
already failing. So when a replica is ejected, each stream on it gets one more probe round
(`health.interval_s + health.timeout_s`): a stream that has received nothing since the ejection, from a
replica still ejected, is aborted (the client gets an `upstream_stream_error` event and `[DONE]`).
A stream still receiving data is left alone, whatever the probes say.
"""

from __future__ import annotations

import asyncio
import time

from ember.gateway.config import HealthConfig
from ember.gateway.proxy import UpstreamResult
from ember.gateway.replicas import PoolEvent, Replica, ReplicaPool


class StalledStreams:
    def __init__(self, pool: ReplicaPool, health: HealthConfig):
        self.grace_s = health.interval_s + health.timeout_s
        self._streams: dict[str, set[UpstreamResult]] = {}
        pool.add_listener(self._on_pool_event)

    def watch(self, result: UpstreamResult) -> None:
        """A stream now under way (until `forget`)."""
        self._streams.setdefault(result.replica.id, set()).add(result)
        if not result.replica.healthy:  # ejected while its first event was on the way
            self._check_later(result.replica)

    def forget(self, result: UpstreamResult) -> None:
        streams = self._streams.get(result.replica.id)
        if streams is not None:
            streams.discard(result)
            if not streams:
                del self._streams[result.replica.id]

    def _on_pool_event(self, event: PoolEvent, replica: Replica) -> None:
        if event == "eject" and self._streams.get(replica.id):
            self._check_later(replica)

    def _check_later(self, replica: Replica) -> None:
        since = time.monotonic()
        asyncio.get_running_loop().call_later(self.grace_s, self._abort_silent, replica, since)

    def _abort_silent(self, replica: Replica, since: float) -> None:
        if replica.healthy:
            return  # re-admitted meanwhile
        for result in list(self._streams.get(replica.id, ())):
            if result.last_data_at < since:
                result.abort(f"no data from the replica since it was ejected ({replica.ejection_reason})")
