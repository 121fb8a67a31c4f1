"""RMSNorm with an optional fused residual add (the pre-norm transformer's `x + residual` then norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.native import NativeKernels


class RMSNorm(nn.Module):
    native: NativeKernels | None = None  # the fused add + norm kernel, for bfloat16 on CPU (model runner sets it)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        # Lower precision: Hugging Face normalizes in float32, rounds, then scales. rms_norm without a weight
        # computes in float32 and rounds once, so the same bits come out without the two dtype copies.
        return F.rms_norm(x, self.normalized_shape, None, self.eps) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); without a residual, x itself is the new residual."""
        if self.native is not None:
            return self.native.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
