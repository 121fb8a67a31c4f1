"""Latency of one all-reduce between two ranks on this host: shared memory (ShmAllReduce) vs gloo, for the
hidden-state sizes of SmolLM2-135M decode steps (576 features, float32). Run: PYTHONPATH=. python
benchmarks/engine/allreduce_latency.py"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import uuid

import torch
import torch.distributed as dist

from ember.engine.shm_allreduce import ShmAllReduce, shm_path
from tests.conftest import free_port

ROWS, HIDDEN, CALLS = (1, 32), 576, 2000


def rank_main(rank: int, port: int, path: str) -> None:
    os.sched_setaffinity(0, [rank % os.cpu_count()])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    gloo = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    slot_bytes = max(ROWS) * HIDDEN * 4
    # Rank 0 creates the file before rank 1 maps it (as the engine does).
    shm = (
        ShmAllReduce(path, rank, 2, slot_bytes, create=True, peers_alive=lambda: True) if rank == 0 else None
    )
    gloo.allreduce([torch.zeros(1)]).wait()
    shm = shm or ShmAllReduce(path, rank, 2, slot_bytes, create=False, peers_alive=lambda: True)
    gloo.allreduce([torch.zeros(1)]).wait()
    if rank == 0:
        shm.unlink()
    for rows in ROWS:
        tensor = torch.ones(rows, HIDDEN)
        for name, reduce in (("gloo", lambda t: gloo.allreduce([t]).wait()), ("shm", shm)):
            for _ in range(100):
                reduce(tensor)
            started = time.perf_counter()
            for _ in range(CALLS):
                reduce(tensor)
            if rank == 0:
                print(
                    f"{name} [{rows}, {HIDDEN}] float32: {1e6 * (time.perf_counter() - started) / CALLS:.1f} us",
                    flush=True,
                )


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    port, path = free_port(), shm_path(f"bench-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    processes = [context.Process(target=rank_main, args=(rank, port, path)) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
