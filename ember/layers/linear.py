"""A Linear layer whose weight oneDNN can pre-pack once for bfloat16 on CPU.

`F.linear` on a plain bfloat16 weight makes oneDNN reorder the weight into its blocked (AMX/AVX512-BF16)
layout on every call; a small model streams all of its weights each step, so those reorders cost about a
third of every matmul. Packing once at load time removes them, with bit-identical results. float32 keeps
the plain path: packed float32 is not faster there and rounds differently."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.native import NativeKernels


class Linear(nn.Linear):
    """nn.Linear plus optional pre-packed copies of the weight that forward uses when present: oneDNN's, and
    for decode batches the native decode GEMM's (ember/kernels/amx_gemm.c or small_gemm.c)."""

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
    """Pre-pack every Linear of `model` (bfloat16 weights on a CPU with native bfloat16; after loading)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)


def pack_gemm_weights(model: nn.Module, native: NativeKernels) -> None:
    """Give every Linear whose shape the native decode GEMM takes its re-laid-out weight (after loading)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.gemm_weight = native.pack_gemm_weight(module.weight.detach())
