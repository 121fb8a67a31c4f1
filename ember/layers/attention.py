"""Paged attention over a block-structured KV cache, with per-step metadata shared by every layer.

Layout of one layer's cache: [num_blocks, block_size, 2 (K, V), num_kv_heads, head_dim], or its int8 form
(ember/layers/kv_cache.py). A token at position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size.

Each step's sequences are split into groups (single-token decodes, then multi-token prefill chunks). A group
runs as ONE scaled_dot_product_attention call: its sequences' K/V are gathered block-wise into a padded batch
with one index_select over whole blocks (blocks-first, each block one contiguous run of K and V: the cheapest
gather, about twice as fast as a head-major layout's), SDPA reads K and V as strided [B, kv_heads, L, head_dim]
views of it, and a precomputed additive mask hides padding and future tokens. K/V heads are never repeated:
decodes fold the query heads sharing a KV head into the query axis, prefill chunks use SDPA's grouped-query
mode.

Where ember's native kernels run (ember/kernels/native.py), all single-token queries of a step
form one group that the kernel answers reading K/V in place: no gather, no padding, no mask; so do all
prompt chunks of a step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.native import NativeKernels
from ember.layers.kv_cache import gather_blocks, write_kv

# Padded K/V slots one group gathers. Bounded so the gathered batch stays in cache for SDPA and never needs
# fresh (page-faulting) memory: one big gather of many sequences costs more per slot (docs/benchmarks.md).
MAX_GROUP_KV_SLOTS = 8192


@dataclass
class SequenceSpan:
    """What attention needs to know about one scheduled sequence."""

    num_computed_tokens: int  # tokens already in the cache (the context before this step's tokens)
    num_new_tokens: int  # tokens computed this step
    block_table: list[int]
    # The new tokens are prompt tokens: a chunk to attention even when one token (the tail of a prompt served
    # from the prefix cache), so that it gets the values it gets within a longer chunk.
    prompt: bool = False

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and not self.prompt


@dataclass
class AttentionGroup:
    token_start: int  # the group's rows in the step's flat token batch: [token_start, token_end)
    token_end: int
    num_seqs: int
    query_len: int  # longest query of the group; shorter ones are padded
    query_index: torch.Tensor | None  # [B * query_len] rows of the flat batch; None when rows are exactly [B, Lq]
    output_index: torch.Tensor | None  # real rows of the padded [B * query_len] output; None when no padding
    block_ids: torch.Tensor  # [B * num_blocks] physical blocks to gather, padded with block 0 (masked)
    kv_len: int  # keys attended per sequence after the gather (num_blocks * block_size, or exact for B == 1)
    mask: torch.Tensor | None  # additive [B, 1, query_len, kv_len]; None when every key is visible
    context_lens: torch.Tensor | None = None  # [B] keys per sequence; set when a native kernel runs the group
    query_starts: torch.Tensor | None = None  # [B + 1] the sequences' first rows; set for native prefill


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]
    native: NativeKernels | None = None  # runs the groups that have context_lens
    # Some row computes a prompt token: models may run such steps apart (LlamaForCausalLM's stack tables).
    prompt_rows: bool = False


def build_attention_metadata(
    spans: list[SequenceSpan],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    native: NativeKernels | None = None,
) -> AttentionMetadata:
    """Build once per step. `spans` are in flat-batch order. Consecutive single-token spans form decode groups
    and consecutive multi-token spans prefill groups, each gathering at most MAX_GROUP_KV_SLOTS padded K/V
    slots; callers put decodes first, sorted by context length, so a group's sequences pad little. With
    `native` kernels, consecutive single-token spans form one group whatever their size (nothing is gathered),
    and so do consecutive prompt chunks."""
    slots = []
    for span in spans:
        positions = np.arange(span.num_computed_tokens, span.num_computed_tokens + span.num_new_tokens)
        table = np.asarray(span.block_table, dtype=np.int64)
        slots.append(table[positions // block_size] * block_size + positions % block_size)
    slot_mapping = torch.from_numpy(np.concatenate(slots)).to(device)

    groups = []
    start = 0
    token_start = 0
    while start < len(spans):
        is_decode = spans[start].is_decode
        in_place = native is not None
        num_blocks = _num_context_blocks(spans[start], block_size)
        end = start + 1
        while end < len(spans) and spans[end].is_decode == is_decode:
            widest = max(num_blocks, _num_context_blocks(spans[end], block_size))
            if (end - start + 1) * widest * block_size > MAX_GROUP_KV_SLOTS and not in_place:
                break
            num_blocks = widest
            end += 1
        if in_place:
            group = _build_kernel_group(spans[start:end], token_start, block_size, device, is_decode)
        else:
            group = _build_group(spans[start:end], token_start, block_size, dtype, device)
        groups.append(group)
        token_start = group.token_end
        start = end
    return AttentionMetadata(slot_mapping=slot_mapping, groups=groups, native=native,
                             prompt_rows=any(span.prompt for span in spans))


def _num_context_blocks(span: SequenceSpan, block_size: int) -> int:
    return -(-(span.num_computed_tokens + span.num_new_tokens) // block_size)


def _padded_block_tables(spans: list[SequenceSpan], context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """[B, blocks of the longest context] block ids, padded with block 0 (never read unmasked)."""
    tables = np.zeros((len(spans), int(-(-context_lens.max() // block_size))), dtype=np.int64)
    for row, span in enumerate(spans):
        used = -(-int(context_lens[row]) // block_size)
        tables[row, :used] = span.block_table[:used]
    return tables


def _build_kernel_group(
    spans: list[SequenceSpan], token_start: int, block_size: int, device: torch.device, is_decode: bool
) -> AttentionGroup:
    query_lens = np.array([s.num_new_tokens for s in spans])
    context_lens = np.array([s.num_computed_tokens for s in spans]) + query_lens
    block_tables = _padded_block_tables(spans, context_lens, block_size)
    num_blocks = block_tables.shape[1]
    query_starts = None if is_decode else torch.from_numpy(np.concatenate(([0], np.cumsum(query_lens)))).to(device)
    return AttentionGroup(
        token_start=token_start,
        token_end=token_start + int(query_lens.sum()),
        num_seqs=len(spans),
        query_len=int(query_lens.max()),
        query_index=None,
        output_index=None,
        block_ids=torch.from_numpy(block_tables.reshape(-1)).to(device),
        kv_len=num_blocks * block_size,
        mask=None,
        context_lens=torch.from_numpy(context_lens).to(device),
        query_starts=query_starts,
    )


def _build_group(
    spans: list[SequenceSpan],
    token_start: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionGroup:
    num_seqs = len(spans)
    query_lens = np.array([s.num_new_tokens for s in spans])
    computed = np.array([s.num_computed_tokens for s in spans])
    context_lens = computed + query_lens
    query_len = int(query_lens.max())
    num_tokens = int(query_lens.sum())
    block_ids = _padded_block_tables(spans, context_lens, block_size)
    num_blocks = block_ids.shape[1]
    # One sequence needs no padding: attend to exactly its context (a strided view of the gathered blocks).
    kv_len = int(context_lens[0]) if num_seqs == 1 else num_blocks * block_size

    query_index = output_index = None
    if not (query_lens == query_len).all():
        offsets = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
        steps = np.arange(query_len)
        # Padded query rows repeat the sequence's last real token; their outputs are dropped.
        rows = offsets[:, None] + np.minimum(steps[None, :], query_lens[:, None] - 1)
        query_index = torch.from_numpy(token_start + rows.reshape(-1)).to(device)
        real = steps[None, :] < query_lens[:, None]
        output_index = torch.from_numpy(np.flatnonzero(real.reshape(-1))).to(device)

    mask = None
    if query_len > 1 or (context_lens != kv_len).any():
        # Query i of a sequence sits at position computed + i and sees keys at positions <= its own.
        query_positions = computed[:, None] + np.arange(query_len)[None, :]
        visible = np.arange(kv_len)[None, None, :] <= query_positions[:, :, None]
        additive = torch.zeros(visible.shape, dtype=dtype).masked_fill_(torch.from_numpy(~visible), float("-inf"))
        mask = additive.unsqueeze(1).to(device)
    return AttentionGroup(
        token_start=token_start,
        token_end=token_start + num_tokens,
        num_seqs=num_seqs,
        query_len=query_len,
        query_index=query_index,
        output_index=output_index,
        block_ids=torch.from_numpy(block_ids.reshape(-1)).to(device),
        kv_len=kv_len,
        mask=mask,
    )


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_queries_per_kv = num_heads // num_kv_heads

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] (strided views are fine) -> [T, heads * D].

        Writes this step's K/V into their slots first (unless the caller did: `kv_written`), so every query
        also sees its own chunk's keys."""
        if not kv_written:
            write_kv(kv_cache, meta.slot_mapping, k, v)
        outputs = [self._attend_group(q, kv_cache, group, meta.native) for group in meta.groups]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _attend_group(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, native: NativeKernels | None
    ) -> torch.Tensor:
        if group.context_lens is None:
            return self._attend_group_sdpa(q, kv_cache, group)
        q = q[group.token_start : group.token_end]
        block_tables = group.block_ids.view(group.num_seqs, -1)
        if group.query_starts is None:
            return native.paged_decode_attention(q, kv_cache, block_tables, group.context_lens, self.head_dim**-0.5)
        return native.paged_prefill_attention(
            q, kv_cache, block_tables, group.query_starts, group.context_lens, self.head_dim**-0.5
        )

    def _attend_group_sdpa(self, q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        num_seqs, query_len = group.num_seqs, group.query_len
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        if group.query_index is None:
            q = q[group.token_start : group.token_end]
        else:
            q = q.index_select(0, group.query_index)
        kv = gather_blocks(kv_cache, group.block_ids, kv_heads, head_dim, q.dtype)
        kv = kv.view(num_seqs, -1, 2, kv_heads, head_dim)[:, : group.kv_len]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        if query_len == 1:
            # Decode: the query heads sharing a KV head become that head's query rows (the mask broadcasts).
            q = q.view(num_seqs, kv_heads, self.num_queries_per_kv, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask)
            return out.reshape(num_seqs, self.num_heads * head_dim)
        q = q.view(num_seqs, query_len, self.num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(num_seqs * query_len, self.num_heads * head_dim)
        return out if group.output_index is None else out.index_select(0, group.output_index)
