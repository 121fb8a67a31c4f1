"""A Linear layer whose weight can be pre-packed once for bfloat16 on CPU: for ember's native GEMM, or for oneDNN.

`F.linear` on a plain bfloat16 weight makes oneDNN reorder the weight into its blocked (AMX/AVX512-BF16)
layout on every call; a small model streams all of its weights each step, so those reorders cost about a
third of every matmul. Packing once at load time removes them, with bit-identical results. float32 keeps
the plain path: packed float32 is not faster there and rounds differently. Where the native GEMM takes every
row count (AMX), it replaces oneDNN and the oneDNN copy is not made."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.native import ANY_ROWS, NativeKernels


class Linear(nn.Linear):
    """nn.Linear plus optional pre-packed copies of the weight that forward uses when present: the native
    GEMM's (ember/kernels/amx_gemm.c for every batch, or small_gemm.c for decode batches of a few rows), then
    oneDNN's."""

    packed_weight: torch.Tensor | None = None
    native: NativeKernels | None = None
    gemm_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm_weight is not None and 0 < x.shape[0] <= self.native.gemm_max_rows:
            return self.native.gemm(x, self.gemm_weight, self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linear_weights(model: nn.Module) -> None:
    """Pre-pack for oneDNN every Linear of `model` that the native GEMM does not take at every row count
    (bfloat16 weights on a CPU with native bfloat16; after loading and pack_gemm_weights)."""
    for module in model.modules():
        if isinstance(module, Linear) and (module.gemm_weight is None or module.native.gemm_max_rows < ANY_ROWS):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)


def pack_gemm_weights(model: nn.Module, native: NativeKernels) -> None:
    """Give every Linear whose shape the native GEMM takes its re-laid-out weight (after loading)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.gemm_weight = native.pack_gemm_weight(module.weight.detach())
