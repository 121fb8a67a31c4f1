"""The paged KV cache's storage: in the model's dtype, or in int8 with a scale per token and head
(`--kv-cache-dtype int8`, as llama.cpp's `-ctk q8_0 -ctv q8_0` or vLLM's `--kv-cache-dtype fp8`).

One layer's cache, in the model's dtype: [num_blocks, block_size, 2 (K, V), num_kv_heads, head_dim]. In int8:
[num_blocks, block_size, row_bytes] int8, where a token's row is its K then V of every KV head in int8
([2, num_kv_heads, head_dim]) followed by their float32 scales ([2, num_kv_heads], as bytes). A head's values are
round(x / scale), scale = max |x| / 127. ember/kernels/kv_cache.h reads and writes the same rows, so the native
kernels and these PyTorch ops share one cache. A token at position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size in both."""

from __future__ import annotations

import torch


def int8_row_bytes(num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one token's row of one layer's int8 cache: K and V values, then their float32 scales."""
    return 2 * num_kv_heads * head_dim + 2 * num_kv_heads * 4


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes one token's K and V take in one layer's cache."""
    if kv_cache_dtype == "int8":
        return int8_row_bytes(num_kv_heads, head_dim)
    return 2 * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, kv_cache_dtype: str, device: torch.device) -> torch.Tensor:
    """Every layer's cache in one zeroed tensor (index 0 = layer): padding slots are read (and masked), and a
    masked key must still be finite for softmax @ V; an int8 cache's zero scales dequantize to zeros."""
    if kv_cache_dtype == "int8":
        shape: tuple[int, ...] = (num_layers, num_blocks, block_size, int8_row_bytes(num_kv_heads, head_dim))
        return torch.zeros(shape, dtype=torch.int8, device=device)
    shape = (num_layers, num_blocks, block_size, 2, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def int8_views(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's (or gathered blocks') rows as views: values [slots, 2, kv_heads, head_dim] int8 and
    scales [slots, 2, kv_heads] float32."""
    rows = kv_cache.view(-1, int8_row_bytes(num_kv_heads, head_dim))
    values_width = 2 * num_kv_heads * head_dim
    values = rows[:, :values_width].view(-1, 2, num_kv_heads, head_dim)
    scales = rows[:, values_width:].view(torch.float32).view(-1, 2, num_kv_heads)
    return values, scales


def quantize_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [T, 2, kv_heads, head_dim] (any float dtype) -> int8 values of the same shape and float32 scales
    [T, 2, kv_heads]: per head, scale = max |x| / 127 and values round(x / scale) (0 for a head of zeros),
    computed in float32 as kv_cache.h's kv_int8_store."""
    x = kv.float()
    scales = x.abs().amax(dim=-1) / 127.0
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(x / divisors.unsqueeze(-1)).to(torch.int8), scales


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] into their slots of one layer's cache (quantized where it is int8)."""
    kv = torch.stack((k, v), dim=1)
    if kv_cache.dtype != torch.int8:
        kv_cache.view(-1, *kv.shape[1:]).index_copy_(0, slot_mapping, kv)
        return
    values, scales = int8_views(kv_cache, k.shape[1], k.shape[2])
    quantized, kv_scales = quantize_kv(kv)
    values.index_copy_(0, slot_mapping, quantized)
    scales.index_copy_(0, slot_mapping, kv_scales)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The K/V of blocks `block_ids` of one layer's cache, in order -> [len(block_ids) * block_size, 2,
    kv_heads, head_dim] in `dtype` (an int8 cache's dequantized: values * scale, in float32 first)."""
    blocks = kv_cache.index_select(0, block_ids)
    if kv_cache.dtype != torch.int8:
        return blocks.view(-1, 2, num_kv_heads, head_dim)
    values, scales = int8_views(blocks, num_kv_heads, head_dim)
    return (values.float() * scales.unsqueeze(-1)).to(dtype)
