"""Tensor parallelism: how a model's layers split across ranks, and the collectives between them.

Megatron-style: q/k/v and gate/up are column-parallel (each rank owns some heads and some intermediate
features), o_proj and down_proj row-parallel (each rank's partial sum is all-reduced), the embedding and LM
head vocabulary-parallel (embedding rows outside a rank's range are zero before the all-reduce; logits are
all-gathered). Heads split by KV head: each rank owns a run of KV heads and the query heads that attend to
them (as evenly as the KV heads allow: SmolLM2-135M's 3 KV heads go 1 + 2 over two ranks). With fewer KV heads
than ranks, the query heads split evenly and each KV head is replicated on the ranks whose query heads use it. Rank 0 is the engine process; ranks 1..N-1 are worker processes (ember/engine/tp_worker.py).

Collectives run on a torch.distributed process group built without the global default group (so several
engines may live in one process): gloo on CPU, NCCL on CUDA. On CPU the all-reduce goes through shared
memory when every rank is on this host (ember/engine/shm_allreduce.py), gloo otherwise."""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ember.errors import EmberError

if TYPE_CHECKING:  # ember.models imports this module
    from ember.models.config import ModelConfig

# How long a collective (and the start-up rendezvous, which waits for every rank to load its shard) may wait.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallelError(RuntimeError):
    """A rank failed or died: the engine cannot run another step."""


@dataclass(frozen=True)
class ShardLayout:
    """Which part of the model one rank holds."""

    rank: int
    size: int
    first_head: int
    num_heads: int  # query heads of this rank
    first_kv_head: int
    num_kv_heads: int  # KV heads of this rank (replicated ones included)
    intermediate_size: int
    vocab_per_rank: int  # the vocabulary padded to a multiple of size, divided

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, size: int) -> ShardLayout:
        check_tensor_parallel(config, size)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads >= size:
            first_kv, end_kv = rank * kv_heads // size, (rank + 1) * kv_heads // size
            group = heads // kv_heads
            first_head, num_heads, num_kv = first_kv * group, (end_kv - first_kv) * group, end_kv - first_kv
        else:  # replicated: rank r's query heads all use KV head r * kv_heads // size
            num_heads = heads // size
            first_head, first_kv, num_kv = rank * num_heads, rank * kv_heads // size, 1
        return cls(rank, size, first_head, num_heads, first_kv, num_kv, config.intermediate_size // size,
                   -(-config.vocab_size // size))

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise EmberError unless `config`'s heads and MLP split evenly over `size` ranks."""
    if size == 1:
        return
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads < size and (size % kv_heads or heads % size):
        raise EmberError(f"tensor_parallel_size {size} exceeds the model's {kv_heads} KV heads: to replicate "
                         f"them it must be a multiple of {kv_heads} and divide the {heads} attention heads")
    if config.intermediate_size % size:
        raise EmberError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                         f"{config.intermediate_size}")


class TensorParallelGroup:
    """One rank's view of the group: its layout and the collectives the model and runner call."""

    def __init__(self, layout: ShardLayout, store: dist.Store, device: torch.device,
                 shm_allreduce: Any | None = None) -> None:
        self.layout = layout
        self.rank, self.size = layout.rank, layout.size
        self.device = device
        # Step inputs (pickled objects) always travel over gloo; tensors over NCCL on CUDA.
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), self.rank, self.size,
                                               COLLECTIVE_TIMEOUT)
        self.group = (dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), self.rank, self.size)
                      if device.type == "cuda" else self.cpu_group)
        self.shm_allreduce = shm_allreduce  # a ShmAllReduce, or None: gloo/NCCL all-reduce

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.shm_allreduce is not None and self.shm_allreduce.fits(tensor):
            return self.shm_allreduce(tensor)
        self._wait(self.group.allreduce([tensor]))
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank 0's part first."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [tensor.contiguous()]))
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled: the step's inputs are small)."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.empty(1, dtype=torch.int64)
        self._wait(self.cpu_group.broadcast(length, 0))
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._wait(self.cpu_group.broadcast(payload, 0))
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def barrier(self) -> None:
        self._wait(self.cpu_group.allreduce([torch.zeros(1)]))

    @staticmethod
    def _wait(work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # a peer closed its connection (died) or timed out
            raise TensorParallelError(f"tensor-parallel collective failed: {exc}") from exc
