"""Lua script calls made in one event-loop tick, sent to Redis as one pipelined round trip.

Under load many requests are admitted and settled in the same tick; one `EVALSHA` round trip each cost a
gateway process most of its CPU (a pooled connection, a write and a read, a future per call). Pipelined,
they share one connection, one write and one read. Each script still runs atomically in Redis, one after
the other, exactly as if sent alone, so what a script decides does not change. A script Redis does not
know (after its restart or SCRIPT FLUSH) is loaded and run again, alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

_Call = tuple[AsyncScript, Sequence[str], Sequence[object], asyncio.Future]


class ScriptBatcher:
    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self._queued: list[_Call] = []
        self._flushing: set[asyncio.Task] = set()  # referenced until done

    def run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[object]) -> asyncio.Future:
        """The script's reply, or the Redis error, once this tick's batch has been answered."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._queued:  # the first call of this tick: send the batch at the next one
            loop.call_soon(self._send)
        self._queued.append((script, keys, args, future))
        return future

    def _send(self) -> None:
        batch, self._queued = self._queued, []
        task = asyncio.get_running_loop().create_task(self._round_trip(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _round_trip(self, batch: list[_Call]) -> None:
        pipeline = self.redis.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipeline.evalsha(script.sha, len(keys), *keys, *args)
        try:
            replies = await pipeline.execute(raise_on_error=False)
        except (aioredis.RedisError, OSError) as exc:
            for *_, future in batch:
                _settle(future, exc)
            return
        for call, reply in zip(batch, replies, strict=True):
            script, keys, args, future = call
            if isinstance(reply, NoScriptError):
                try:
                    reply = await script(keys=keys, args=args)  # loads it, then runs it
                except aioredis.RedisError as exc:
                    reply = exc
            _settle(future, reply)


def _settle(future: asyncio.Future, reply: object) -> None:
    if future.done():  # its caller was cancelled
        return
    if isinstance(reply, BaseException):
        future.set_exception(reply)
    else:
        future.set_result(reply)
