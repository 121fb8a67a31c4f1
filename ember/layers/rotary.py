"""Rotary position embedding (RoPE): a cos/sin cache indexed by each token's position.

Supports the original RoPE and Llama 3.1's frequency rescaling (`rope_scaling.rope_type == "llama3"`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for every position up to `max_positions`; `forward(positions)` looks them up once per
    step and every layer reuses the result through `apply_rotary`."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        if scaling is not None:
            rope_type = scaling.get("rope_type", "default")
            if rope_type != "llama3":
                raise ValueError(f"unsupported rope scaling type {rope_type!r}")
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        half_cos, half_sin = freqs.cos(), freqs.sin()
        self.half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: folding the sign into the cache makes the
        # rotation three elementwise ops with the same rounding as the reference formulation.
        self.register_buffer("cos", torch.cat((half_cos, half_cos), -1).to(dtype), persistent=False)
        self.register_buffer("sin_signed", torch.cat((-half_sin, half_sin), -1).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (may be a strided view) by the per-token angles; returns a new tensor."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
