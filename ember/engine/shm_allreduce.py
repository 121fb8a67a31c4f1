"""All-reduce through shared memory between tensor-parallel ranks on one host (CPU), the fast path vLLM and
SGLang use on CPU instead of gloo's TCP loopback.

One file in /dev/shm, mapped by every rank: a flag per rank, then two buffers (alternate calls use
alternate buffers) of one slot per rank. A call writes this rank's tensor into its slot, publishes the call's
sequence number in its flag, waits until every flag has reached it, then sums the slots in rank order, so
every rank computes the same sum bit for bit. With two buffers a rank may only overwrite a slot two calls
later, and by then every rank has published the call in between, which it does only after it finished
reading. The flags are plain stores: this relies on x86's ordering of stores (the data before the flag).

Waiting: a rank polls the flags briefly (a peer running on its own core arrives within microseconds), then
sleeps on the lagging rank's flag (a futex, which that rank wakes after publishing), so that on a host with
more busy processes than cores the waiting rank gives its core to the one it waits for instead of spinning
through its time slice."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch

from ember.engine.futex import Futex
from ember.engine.parallel import COLLECTIVE_TIMEOUT, TensorParallelError

FLAG_STRIDE = 64  # bytes: one cache line per rank's flag
SPINS_BEFORE_SLEEP = 200  # polls of the flags (about a microsecond each) before sleeping on a futex
SLEEP_S = 0.005  # the longest sleep between checks that the other ranks are still alive


def shm_path(tag: str) -> str:
    return f"/dev/shm/ember-tp-{tag}"


class ShmAllReduce:
    """One rank's handle on the shared segment. Rank 0 creates the file (create=True) before the workers
    start; after every rank has mapped it, rank 0 unlinks it, so nothing is left behind by a crash."""

    def __init__(
        self, path: str, rank: int, size: int, max_bytes: int, create: bool, peers_alive: Callable[[], bool]
    ) -> None:
        self.rank, self.size, self.max_bytes = rank, size, max_bytes
        self.path = path
        self.peers_alive = peers_alive
        data_offset = size * FLAG_STRIDE
        total = data_offset + 2 * size * max_bytes
        if create:
            with open(path, "wb") as file:
                file.truncate(total)
        mapped = np.memmap(path, dtype=np.uint8, mode="r+", shape=(total,))
        self.flags = mapped[:data_offset].view(np.int64)[:: FLAG_STRIDE // 8]
        self._flags_address = mapped.ctypes.data
        self.futex = Futex()
        # slots[buffer][rank]: a uint8 tensor over that rank's slot
        self.slots = [
            [
                torch.from_numpy(mapped[start : start + max_bytes])
                for start in range(
                    data_offset + (b * size) * max_bytes, data_offset + (b + 1) * size * max_bytes, max_bytes
                )
            ]
            for b in range(2)
        ]
        self.calls = 0

    def unlink(self) -> None:
        os.unlink(self.path)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.max_bytes

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        self.calls += 1
        slots = self.slots[self.calls % 2]
        num_bytes = tensor.numel() * tensor.element_size()
        views = [slot[:num_bytes].view(tensor.dtype).view(tensor.shape) for slot in slots]
        views[self.rank].copy_(tensor)
        self.flags[self.rank] = self.calls
        self.futex.wake(self._flag_address(self.rank))
        self._wait_for_all(self.calls)
        tensor.copy_(views[0])
        for view in views[1:]:
            tensor.add_(view)
        return tensor

    def _flag_address(self, rank: int) -> int:
        return self._flags_address + rank * FLAG_STRIDE  # the flag's low 32 bits (little-endian)

    def _wait_for_all(self, call: int) -> None:
        flags = self.flags
        for _ in range(SPINS_BEFORE_SLEEP):
            if flags.min() >= call:
                return
        started = time.monotonic()
        while True:
            lagging = int(flags.argmin())
            seen = int(flags[lagging])
            if seen >= call:
                return
            # Returns at once if the flag changed since it was read (no wake-up is lost).
            self.futex.wait(self._flag_address(lagging), seen, SLEEP_S)
            if not self.peers_alive():
                raise TensorParallelError("shared-memory all-reduce: another rank died")
            if time.monotonic() - started > COLLECTIVE_TIMEOUT.total_seconds():
                raise TensorParallelError("shared-memory all-reduce: timed out waiting for the other ranks")
