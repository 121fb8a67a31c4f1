"""SwiGLU's gate: silu(gate) * up over the fused gate_up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.native import NativeKernels


class SiluAndMul(nn.Module):
    native: NativeKernels | None = None  # one fused pass for bfloat16 on CPU (the model runner sets it)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
