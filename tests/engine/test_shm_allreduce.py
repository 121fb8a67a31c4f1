"""The shared-memory all-reduce between two processes equals gloo's all-reduce bit for bit, for float32 and
bfloat16 tensors of several shapes, call after call (both buffers reused), and falls back to gloo for a
tensor larger than its slots."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from ember.engine.shm_allreduce import ShmAllReduce, shm_path
from tests.conftest import free_port

SHAPES = [(1, 576), (7, 576), (32, 64), (256, 576)]
MAX_BYTES = 256 * 576 * 4


def rank_inputs(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    tensors = [torch.randn(shape, generator=generator) * 10 for shape in SHAPES]
    return tensors + [t.to(torch.bfloat16) for t in tensors]


def join(rank: int, port: int, path: str) -> tuple[dist.ProcessGroup, ShmAllReduce]:
    """This rank's gloo group and shared-memory all-reduce, as the engine sets them up: rank 0 creates the
    file before rank 1 maps it, and unlinks it once both have."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    gloo = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    shm = ShmAllReduce(path, rank, 2, MAX_BYTES, create=True, peers_alive=lambda: True) if rank == 0 else None
    gloo.allreduce([torch.zeros(1)]).wait()
    shm = shm or ShmAllReduce(path, rank, 2, MAX_BYTES, create=False, peers_alive=lambda: True)
    gloo.allreduce([torch.zeros(1)]).wait()
    if rank == 0:
        shm.unlink()
    return gloo, shm


def run_two_ranks(target) -> dict[int, tuple]:
    """Run target(rank, port, path, results) in two spawned processes; each puts (rank, ...) on results."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    path = shm_path(f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    port = free_port()
    processes = [context.Process(target=target, args=(rank, port, path, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    outcomes = dict((rank, rest) for rank, *rest in (results.get(timeout=120) for _ in processes))
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert not os.path.exists(path)
    return outcomes


def reduce_both_ways(rank: int, port: int, path: str, results: multiprocessing.Queue) -> None:
    gloo, shm = join(rank, port, path)
    by_gloo, by_shm = [], []
    for _ in range(3):  # both buffers, then the first again
        for tensor in rank_inputs(rank):
            expected = tensor.clone()
            gloo.allreduce([expected]).wait()
            by_gloo.append(expected)
            by_shm.append(shm(tensor.clone()))
    too_large = torch.ones(MAX_BYTES // 4 + 1)
    as_arrays = [[t.float().numpy() for t in tensors] for tensors in (by_gloo, by_shm)]  # exact for bfloat16
    results.put((rank, *as_arrays, shm.fits(too_large), shm.calls))


def test_shm_all_reduce_equals_gloo_bit_for_bit():
    outcomes = run_two_ranks(reduce_both_ways)
    for rank in (0, 1):
        by_gloo, by_shm, fits_too_large, calls = outcomes[rank]
        assert len(by_shm) == 3 * 2 * len(SHAPES) == calls
        for expected, got in zip(by_gloo, by_shm, strict=True):
            assert np.array_equal(got, expected)
        assert not fits_too_large
    assert all(np.array_equal(a, b) for a, b in zip(outcomes[0][1], outcomes[1][1], strict=True))


PEER_DELAY_S = 1.0


def wait_for_a_late_peer(rank: int, port: int, path: str, results: multiprocessing.Queue) -> None:
    _, shm = join(rank, port, path)
    if rank == 1:
        time.sleep(PEER_DELAY_S)
    cpu_started, started = time.thread_time(), time.monotonic()
    total = shm(torch.ones(4))
    results.put((rank, time.thread_time() - cpu_started, time.monotonic() - started, total.tolist()))


def test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_spinning():
    """On a host with more busy processes than cores, a spinning waiter would take the core its peer needs."""
    outcomes = run_two_ranks(wait_for_a_late_peer)
    cpu, waited, total = outcomes[0]
    assert total == [2.0] * 4 and outcomes[1][2] == [2.0] * 4
    assert waited >= 0.5 * PEER_DELAY_S  # it did wait for the peer...
    assert cpu < 0.2 * waited  # ...mostly asleep (a spinning or yielding loop uses the whole wait)
