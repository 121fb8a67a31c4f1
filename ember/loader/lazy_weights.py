"""Checkpoint tensors read on demand, whole or as a range of rows or columns.

safetensors and GGUF files are memory-mapped, so reading a slice touches only that slice's bytes: a
tensor-parallel rank materializes its shard and never the full model (ember/models/llama.py's
load_weights asks for each rank's rows or columns). The formats' sources: SafetensorsTensor
(ember/loader/hf.py), GGUFTensor (ember/loader/gguf.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

import torch

from ember.kernels.quantized_weight import QuantizedWeight


class TensorSource(Protocol):
    """One checkpoint tensor, not yet read."""

    shape: tuple[int, ...]

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Elements start..start+length along `dim` (0 or 1), in memory of their own (not a view of the
        file's map), in the checkpoint's dtype (float32 for quantized tensors)."""
        ...


class LazyStateDict(Mapping[str, torch.Tensor]):
    """Hugging Face name -> tensor, read when asked for: `state_dict[name]` reads it whole, `read(...)` a
    slice. Tensors come back in `dtype` (None: as stored)."""

    def __init__(self, sources: Mapping[str, TensorSource], dtype: torch.dtype | None) -> None:
        self.sources = dict(sources)
        self.dtype = dtype

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor | QuantizedWeight]) -> LazyStateDict:
        """Tensors already in memory (a test's state dict, a model built in-process)."""
        if isinstance(tensors, LazyStateDict):
            return tensors
        return cls({name: in_memory(tensor) for name, tensor in tensors.items()}, None)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def __contains__(self, name: object) -> bool:
        return name in self.sources  # Mapping's default would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.sources[name].shape

    def quantized(self, name: str) -> QuantizedWeight | None:
        """`name`'s weight if it is kept in quantized blocks (--quantization), else None."""
        source = self.sources[name]
        return source.weight if isinstance(source, QuantizedSource) else None

    def read(self, name: str, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        """`name`'s elements start..start+length along `dim` (all of them by default)."""
        source = self.sources[name]
        length = source.shape[dim] - start if length is None else length
        tensor = source.read(dim, start, length)
        return tensor if self.dtype is None else tensor.to(self.dtype)


class InMemoryTensor:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        if length == self.shape[dim]:
            return self.tensor
        # A copy, so that the caller's slice does not keep the whole tensor alive.
        return self.tensor.narrow(dim, start, length).clone()


class QuantizedSource:
    """A Linear weight kept in its quantized blocks (a GGUF block type of GGUF_BLOCK_FORMATS, with --quantization
    gguf): the model takes it whole (LazyStateDict.quantized); a float read dequantizes it, as quant_gemm.c does."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight
        self.shape = tuple(weight.shape)

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.weight.dequantize().narrow(dim, start, length).clone()


def in_memory(tensor: torch.Tensor | QuantizedWeight) -> InMemoryTensor | QuantizedSource:
    return QuantizedSource(tensor) if isinstance(tensor, QuantizedWeight) else InMemoryTensor(tensor)
