"""Tensor-parallel ranks 1..N-1: processes the engine (rank 0) starts, binds to their cores and supervises.

Each worker joins the group, loads only its shard, then runs every step rank 0 broadcasts. A worker that
dies is noticed twice: rank 0's next collective fails (its peer's connection closes), and the supervisor's
thread logs the exit at once and names it in the error the engine raises."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from ember.engine.args import EngineArgs, parse_cpu_bind
from ember.engine.model_runner import ModelRunner
from ember.engine.parallel import COLLECTIVE_TIMEOUT, ShardLayout, TensorParallelError, TensorParallelGroup
from ember.engine.resources import resolve_device
from ember.engine.shm_allreduce import ShmAllReduce, shm_path
from ember.loader import load_model
from ember.models.config import ModelConfig

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def rank_cores(args: EngineArgs) -> list[list[int]]:
    """Each rank's CPU cores: --cpu-bind's lists, else the cores this process may use split evenly."""
    if args.cpu_bind is not None:
        return parse_cpu_bind(args.cpu_bind)
    available = sorted(os.sched_getaffinity(0))
    size = args.tensor_parallel_size
    per_rank = max(1, len(available) // size)
    return [available[r * per_rank : (r + 1) * per_rank] or available for r in range(size)]


def bind_to_cores(cores: list[int]) -> None:
    """Run this process (and torch's intra-op threads) on `cores` only."""
    os.sched_setaffinity(0, cores)


class TensorParallelWorkers:
    """Rank 0's handle on the worker processes: starts them, joins the group with them, watches them."""

    def __init__(self, args: EngineArgs, config: ModelConfig) -> None:
        size = args.tensor_parallel_size
        self.device = resolve_device(args.device)
        cores = rank_cores(args) if self.device.type == "cpu" else None
        store = dist.TCPStore(
            LOOPBACK, 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
        )
        self.failure: str | None = None
        self._worker_died = threading.Event()
        self._stopping = False
        use_shm = self.device.type == "cpu" and args.tensor_parallel_all_reduce == "shm"
        self._shm_file = shm_path(f"{os.getpid()}-{uuid.uuid4().hex[:8]}") if use_shm else None
        self.processes: list[multiprocessing.process.BaseProcess] = []
        # Rank 0 is this process, bound to its own cores while the group runs: stop() gives the rest back (an
        # offline LLM's process goes on after its engine, with every core it had).
        self._cores_before = os.sched_getaffinity(0) if cores is not None else None
        try:
            self.group = self._start(args, config, store, cores)
        except BaseException:
            self.stop()
            raise
        self._store = store  # the workers' rendezvous: lives as long as the group

    def _start(
        self, args: EngineArgs, config: ModelConfig, store: dist.TCPStore, cores: list[list[int]] | None
    ) -> TensorParallelGroup:
        size, path = args.tensor_parallel_size, self._shm_file
        shm = None if path is None else _shm_allreduce(path, args, config, 0, lambda: self.failure is None)
        context = multiprocessing.get_context("spawn")
        for rank in range(1, size):
            process = context.Process(
                target=_worker_main,
                name=f"ember-tp-rank{rank}",
                daemon=True,
                args=(
                    rank,
                    args,
                    config,
                    store.port,
                    None if cores is None else cores[rank],
                    path,
                    logging.getLogger().getEffectiveLevel(),
                ),  # the workers log as the engine's process does
            )
            process.start()
            self.processes.append(process)
        threading.Thread(target=self._watch, name="ember-tp-supervisor", daemon=True).start()
        # At interpreter exit multiprocessing terminates daemon workers (this handler runs before its own):
        # an expected end, not a failure to report.
        atexit.register(setattr, self, "_stopping", True)
        if cores is not None:
            bind_to_cores(cores[0])
        self._wait_for_workers_to_join(store)
        device = self.device if self.device.type == "cpu" else torch.device("cuda", 0)
        return TensorParallelGroup(ShardLayout.for_rank(config, 0, size), store, device, shm)

    def _wait_for_workers_to_join(self, store: dist.Store) -> None:
        """Wait until every worker has announced itself, failing at once if one exits first (the group's
        own rendezvous would wait out COLLECTIVE_TIMEOUT for it)."""
        keys = [f"rank{rank}-joining" for rank in range(1, len(self.processes) + 1)]
        while not store.check(keys):
            if self.failure is not None:
                raise TensorParallelError(f"tensor-parallel worker died while starting: {self.failure}")
            time.sleep(0.05)

    def wait_until_loaded(self) -> None:
        """Return once every rank holds its shard (rank 0's runner built); the shared-memory file, mapped by
        every rank by then, is unlinked so that no crash leaves it behind."""
        self.group.barrier()
        self._remove_shm_file()

    def _remove_shm_file(self) -> None:
        if self._shm_file is not None and os.path.exists(self._shm_file):
            os.unlink(self._shm_file)

    def check_alive(self, error: TensorParallelError) -> TensorParallelError:
        """`error` from a failed collective, naming the dead worker where one died. The supervisor's thread alone
        reaps workers (two threads joining one process race: the loser sees no exit code, as this method did
        when it joined too); it reports a death within a moment of the collective's failure."""
        if self._worker_died.wait(timeout=5.0):
            return TensorParallelError(f"tensor-parallel worker {self.failure}: {error}")
        return error

    def _watch(self) -> None:
        ended = multiprocessing.connection.wait([process.sentinel for process in self.processes])
        if self._stopping:
            return
        dead = [p for p in self.processes if p.sentinel in ended]
        for process in dead:
            process.join()  # sets its exitcode
        self.failure = ", ".join(f"{p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in dead)
        logger.error("tensor-parallel worker died: %s; the engine cannot run another step", self.failure)
        self._worker_died.set()

    def stop(self) -> None:
        """After the runner's shutdown broadcast (or a failed start): wait for the workers to leave, kill any
        that do not."""
        self._stopping = True
        self._remove_shm_file()
        for process in self.processes:
            process.join(timeout=10.0)
            if process.is_alive():
                process.kill()
                process.join()
        if self._cores_before is not None:
            bind_to_cores(sorted(self._cores_before))


def _shm_allreduce(
    path: str, args: EngineArgs, config: ModelConfig, rank: int, peers_alive: Callable[[], bool]
) -> ShmAllReduce:
    # The largest all-reduce of a step: one hidden state per token of the step's budget (larger: gloo).
    max_bytes = args.max_num_batched_tokens * config.hidden_size * config.torch_dtype.itemsize
    return ShmAllReduce(path, rank, args.tensor_parallel_size, max_bytes, rank == 0, peers_alive)


def _load_shard(args: EngineArgs, device: torch.device, group: TensorParallelGroup) -> ModelRunner:
    """This rank's runner, holding only its slice of the weights (the loader reads nothing else)."""
    loaded = load_model(args.model, dtype=args.dtype, device=device)
    return ModelRunner(loaded.config, loaded.state_dict, replace(args, device=str(device)), group)


def _worker_main(
    rank: int,
    args: EngineArgs,
    config: ModelConfig,
    store_port: int,
    cores: list[int] | None,
    shm_file: str | None,
    log_level: int,
) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if cores is not None:
        bind_to_cores(cores)
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        LOOPBACK, store_port, args.tensor_parallel_size, is_master=False, timeout=COLLECTIVE_TIMEOUT
    )
    # The group first: rank 0 waits on it, and a failed load then fails rank 0's barrier at once.
    store.set(f"rank{rank}-joining", "1")
    engine_pid = os.getppid()  # rank 0: while it lives, this process stays its child
    shm = (
        None
        if shm_file is None
        else _shm_allreduce(shm_file, args, config, rank, lambda: os.getppid() == engine_pid)
    )
    group = TensorParallelGroup(
        ShardLayout.for_rank(config, rank, args.tensor_parallel_size), store, device, shm
    )
    runner = _load_shard(args, device, group)
    group.barrier()  # every rank loaded: rank 0 may start stepping
    runner.run_worker_loop()
