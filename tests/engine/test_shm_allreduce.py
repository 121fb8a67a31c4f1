"""The shared-memory all-reduce between two processes equals gloo's all-reduce bit for bit, for float32 and
bfloat16 tensors of several shapes, call after call (both buffers reused), and falls back to gloo for a
tensor larger than its slots."""

from __future__ import annotations

import datetime
import multiprocessing
import os
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


def reduce_both_ways(rank: int, port: int, path: str, results: multiprocessing.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    gloo = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    shm = ShmAllReduce(path, rank, 2, MAX_BYTES, create=rank == 0, peers_alive=lambda: True)
    gloo.allreduce([torch.zeros(1)]).wait()  # both ranks mapped the file
    if rank == 0:
        shm.unlink()
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
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    path = shm_path(f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    port = free_port()
    processes = [context.Process(target=reduce_both_ways, args=(rank, port, path, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    outcomes = dict((rank, rest) for rank, *rest in (results.get(timeout=120) for _ in processes))
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert not os.path.exists(path)
    for rank in (0, 1):
        by_gloo, by_shm, fits_too_large, calls = outcomes[rank]
        assert len(by_shm) == 3 * 2 * len(SHAPES) == calls
        for expected, got in zip(by_gloo, by_shm, strict=True):
            assert np.array_equal(got, expected)
        assert not fits_too_large
    assert all(np.array_equal(a, b) for a, b in zip(outcomes[0][1], outcomes[1][1], strict=True))
