"""ember's native CPU kernels against the PyTorch ops they replace, on random bfloat16 data.

Skipped where they cannot run (no AVX-512 or no C compiler); the engine falls back to PyTorch there."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ember.kernels.native import NativeKernels, load_native_kernels
from ember.layers.activation import SiluAndMul
from ember.layers.attention import PagedAttention, SequenceSpan, build_attention_metadata
from ember.layers.rmsnorm import RMSNorm
from ember.layers.rotary import RotaryEmbedding, apply_rotary

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def exact_chunk_attention(
    q: torch.Tensor, cache: torch.Tensor, chunks: list[tuple[int, int]], tables: list[list[int]]
) -> Iterator[tuple[int, tuple[int, int, int], torch.Tensor]]:
    """Causal attention in float64 for each query row of prompt chunks (cached, new) over their paged K/V
    (already written to `cache`): yields (row, (cached, new, position), exact output of that row)."""
    heads, (kv_heads, head_dim) = q.shape[1], cache.shape[-2:]
    flat = cache.view(-1, 2, kv_heads, head_dim)
    row = 0
    for (cached, new), table in zip(chunks, tables, strict=True):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached + new)]
        keys, values = flat[slots, 0].double(), flat[slots, 1].double()
        for position in range(cached, cached + new):
            query = q[row].double().view(kv_heads, heads // kv_heads, head_dim)
            scores = torch.einsum("ghd,tgd->ght", query, keys[: position + 1]) * head_dim**-0.5
            exact = torch.einsum("ght,tgd->ghd", scores.softmax(-1), values[: position + 1]).reshape(-1)
            yield row, (cached, new, position), exact
            row += 1
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    kernels = load_native_kernels("auto", CPU, torch.bfloat16, (576, 1536), HEAD_DIM, HEADS // KV_HEADS)
    if kernels is None:
        pytest.skip("native kernels cannot run on this machine")
    return kernels


def scrambled_block_tables(lengths: list[int], seed: int) -> tuple[list[list[int]], int]:
    """Block tables for sequences of `lengths` tokens over shuffled physical blocks, and the number of blocks
    (a few more than the tables use)."""
    rng = np.random.default_rng(seed)
    blocks_needed = [-(-n // BLOCK) for n in lengths]
    physical = rng.permutation(sum(blocks_needed) + 4)
    tables, start = [], 0
    for count in blocks_needed:
        tables.append(physical[start : start + count].tolist())
        start += count
    return tables, len(physical)


def scrambled_paged_cache(lengths: list[int], seed: int, kv_heads: int = KV_HEADS
                          ) -> tuple[list[list[int]], torch.Tensor]:
    """Block tables for sequences of `lengths` tokens over shuffled physical blocks, and a random cache."""
    tables, num_blocks = scrambled_block_tables(lengths, seed)
    torch.manual_seed(seed)
    return tables, torch.randn(num_blocks, BLOCK, 2, kv_heads, HEAD_DIM).bfloat16()


def random_qkv(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, D], k and v [T, kv_heads, D]: strided views of one qkv row, as in the model."""
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
    q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
    return q, k, v


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 units in the last place (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def test_add_rms_norm_matches_torch(native: NativeKernels) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.rand(576) + 0.5).bfloat16()
    x, residual = torch.randn(37, 576).bfloat16(), torch.randn(37, 576).bfloat16()
    expected_out, expected_residual = norm(x, residual.clone())
    out, new_residual = native.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert new_residual.data_ptr() == residual.data_ptr()  # the sum lands in the residual buffer
    assert torch.equal(new_residual, expected_residual)
    assert ulps_apart(out, expected_out).max() <= 1
    assert (out == expected_out).float().mean() > 0.99
    first_out, first_residual = native.add_rms_norm(x, None, norm.weight, norm.eps)
    assert first_residual is x
    assert ulps_apart(first_out, norm(x)[0]).max() <= 1


def test_silu_and_mul_matches_torch(native: NativeKernels) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(45, 2 * 1536) * 4).bfloat16()
    expected = SiluAndMul()(gate_up)
    out = native.silu_and_mul(gate_up)
    assert ulps_apart(out, expected).max() <= 1
    assert (out == expected).float().mean() > 0.99


def test_rotary_and_cache_is_bit_exact(native: NativeKernels) -> None:
    torch.manual_seed(2)
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None, torch.bfloat16, CPU)
    tokens = 21
    positions = torch.randint(0, 4096, (tokens,))
    cos, sin = rotary(positions)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
    qk_size = (HEADS + KV_HEADS) * HEAD_DIM
    expected_qk = apply_rotary(qkv[:, :qk_size].view(tokens, -1, HEAD_DIM), cos, sin).reshape(tokens, -1)
    cache = torch.zeros(8, BLOCK, 2, KV_HEADS, HEAD_DIM).bfloat16()
    slots = torch.randperm(8 * BLOCK)[:tokens]
    v = qkv[:, qk_size:].clone()
    native.rotary_and_cache(qkv, cos, sin, slots, cache, HEADS)
    assert torch.equal(qkv[:, :qk_size], expected_qk)
    assert torch.equal(qkv[:, qk_size:], v)
    written = cache.view(-1, 2, KV_HEADS * HEAD_DIM)[slots]
    assert torch.equal(written[:, 0], expected_qk[:, HEADS * HEAD_DIM :])
    assert torch.equal(written[:, 1], v)


@pytest.mark.parametrize("context_lens", [[1, 15, 16, 17, 200, 333], [1], [40]])
def test_paged_decode_attention_matches_exact_attention(native: NativeKernels, context_lens: list[int]) -> None:
    """Scrambled block tables, contexts ending anywhere in a block; one sequence (split by KV head) too."""
    tables, cache = scrambled_paged_cache(context_lens, seed=3)
    spans = [SequenceSpan(n - 1, 1, table) for n, table in zip(context_lens, tables, strict=True)]
    q, k, v = random_qkv(len(spans))
    attention = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)
    meta = build_attention_metadata(spans, BLOCK, torch.bfloat16, CPU, native)
    assert [group.context_lens is not None for group in meta.groups] == [True]
    out = attention(q, k, v, cache, meta)

    flat = cache.view(-1, 2, KV_HEADS, HEAD_DIM)
    for row, (n, table) in enumerate(zip(context_lens, tables, strict=True)):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        keys, values = flat[slots, 0].double(), flat[slots, 1].double()
        query = q[row].double().view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        scores = torch.einsum("ghd,tgd->ght", query, keys) * HEAD_DIM**-0.5
        exact = torch.einsum("ght,tgd->ghd", scores.softmax(-1), values).reshape(-1)
        # bfloat16 output: within half a unit in the last place of the exact result, plus float32 noise.
        assert (out[row].double() - exact).abs().max() <= exact.abs().max() * 2**-8 + 1e-6


@pytest.mark.parametrize("chunks", [
    [(0, 2), (0, 17), (5, 40), (33, 16), (100, 37), (0, 200), (190, 64)],  # (tokens cached, new tokens)
    [(47, 3)],
    # Decodes verifying draft tokens: the query heads of a KV head share a tile (all three, then two per pass).
    [(220, 5), (60, 6), (31, 7), (9, 2)],
])
def test_paged_prefill_attention_matches_exact_attention(native: NativeKernels, chunks: list[tuple[int, int]]) -> None:
    """Prompt chunks with and without cached context before them, of every length modulo the kernel's
    16-query and 32-key blocks, with scrambled block tables; each query sees the keys up to its own."""
    tables, cache = scrambled_paged_cache([cached + new for cached, new in chunks], seed=5)
    spans = [SequenceSpan(cached, new, table) for (cached, new), table in zip(chunks, tables, strict=True)]
    q, k, v = random_qkv(sum(new for _, new in chunks))
    meta = build_attention_metadata(spans, BLOCK, torch.bfloat16, CPU, native)
    assert [group.query_starts is not None for group in meta.groups] == [True]
    out = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)(q, k, v, cache, meta)  # writes the chunks' K/V first

    for row, case, exact in exact_chunk_attention(q, cache, chunks, tables):
        # bfloat16 output, and probabilities rounded to bfloat16 before P V (as PyTorch's CPU flash attention).
        assert (out[row].double() - exact).abs().max() <= exact.abs().max() * 2**-7, case


@pytest.mark.parametrize("kv_heads", [KV_HEADS, HEADS], ids=["3-queries-per-kv", "1-query-per-kv"])
@pytest.mark.parametrize("chunks", [
    [(0, 1)], [(0, 5)], [(0, 16)], [(0, 33)], [(40, 33)],  # one sequence (one row: split by KV head)
    [(0, 5), (17, 16), (100, 33), (3, 1), (64, 16), (0, 33)],  # several, prefix cached or not
])
def test_avx512_prefill_attention_matches_exact_attention(native: NativeKernels, kv_heads: int,
                                                          chunks: list[tuple[int, int]]) -> None:
    """paged_attention.c's row-by-row prompt-chunk attention, the one CPUs without AMX run, at a forced AVX-512
    level (also where AMX would take over): each query row sees the keys up to its own, read in place."""
    kernels = NativeKernels(HEAD_DIM, HEADS // kv_heads, "avx512")  # `native` only skips CPUs without AVX-512
    assert kernels.prefill_isa == "avx512"
    tables, cache = scrambled_paged_cache([cached + new for cached, new in chunks], seed=6, kv_heads=kv_heads)
    qkv = torch.randn(sum(new for _, new in chunks), (HEADS + 2 * kv_heads) * HEAD_DIM).bfloat16()
    q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)  # strided rows, as in the model
    max_blocks = max(len(table) for table in tables)
    block_tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables])
    query_starts = torch.tensor([0, *np.cumsum([new for _, new in chunks])])
    context_lens = torch.tensor([cached + new for cached, new in chunks])
    out = kernels.paged_prefill_attention(q, cache, block_tables, query_starts, context_lens, HEAD_DIM**-0.5)

    for row, case, exact in exact_chunk_attention(q, cache, chunks, tables):
        # bfloat16 output (probabilities stay float32): half a unit in the last place, plus float32 noise.
        assert (out[row].double() - exact).abs().max() <= exact.abs().max() * 2**-8 + 1e-6, case


@pytest.mark.parametrize(("gemm", "rows"), [("avx512_bf16", rows) for rows in (1, 2, 3, 4, 13, 97)]
                         + [("amx", rows) for rows in (1, 7, 16, 17, 32, 45, 64, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_gemm_matches_linear(native: NativeKernels, gemm: str, rows: int, with_bias: bool) -> None:
    kernels = NativeKernels(HEAD_DIM, HEADS // KV_HEADS, native.level, gemm=gemm)  # `native` only skips CPUs without AVX-512
    if kernels.gemm_name is None:
        pytest.skip(f"the CPU (or its kernel) lacks {gemm}")
    torch.manual_seed(4 + rows)
    weight = (torch.randn(960, 576) * 0.05).bfloat16()
    bias = torch.randn(960).bfloat16() if with_bias else None
    wide = torch.randn(rows, 2 * 576).bfloat16()
    x = wide[:, :576]  # rows with a stride of 2 K, as a slice of a wider activation
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    packed = kernels.pack_gemm_weight(weight)
    out = kernels.gemm(x, packed, bias)
    # float32 accumulation in another order, then one rounding: within a bfloat16 ulp of the exact result.
    assert (out.float() - expected).abs().max() <= expected.abs().max() * 2**-8 + 1e-3
    assert torch.equal(kernels.gemm(x.contiguous(), packed, bias), out)
    assert kernels.pack_gemm_weight(torch.zeros(48, 576).bfloat16()) is None  # 48 outputs: not 32-aligned
    with pytest.raises(ValueError, match="got 0"):
        kernels.gemm(x[:0], packed, bias)


@pytest.fixture(scope="module")
def bf16_gemm(native: NativeKernels) -> NativeKernels:
    kernels = NativeKernels(HEAD_DIM, HEADS // KV_HEADS, native.level, gemm="avx512_bf16")
    if kernels.gemm_name is None:
        pytest.skip("the CPU lacks AVX512-BF16")
    return kernels


@pytest.fixture(scope="module")
def amx_gemm(native: NativeKernels) -> NativeKernels:
    kernels = NativeKernels(HEAD_DIM, HEADS // KV_HEADS, native.level, gemm="amx")
    if kernels.gemm_name is None:
        pytest.skip("the CPU lacks AMX")
    return kernels


def assert_within_an_ulp_of_the_exact_product(kernels: NativeKernels, rows: int, n: int, k: int,
                                              with_bias: bool) -> None:
    """float32 sums rounded once: within one bfloat16 ulp of the exact result plus float32's own error on the
    sum (a random walk of k roundings, well under sqrt(k) of its ulps of the products' magnitude), far below
    what rounding a partial sum to bfloat16 would add."""
    generator = torch.Generator().manual_seed(rows * 7 + k)
    weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, k + 10, generator=generator).bfloat16()[:, :k]  # a row stride above k
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    out = kernels.gemm(x, kernels.pack_gemm_weight(weight), bias)
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7)
    assert ((out.double() - exact).abs() <= ulp + k**0.5 * 2.0**-24 * magnitude).all()


@pytest.mark.parametrize("rows", [*range(1, 41), 300])
@pytest.mark.parametrize(("n", "k"), [(64, 34), (960, 576), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_within_an_ulp_of_the_exact_product(bf16_gemm: NativeKernels, rows: int, n: int, k: int,
                                                      with_bias: bool) -> None:
    """Every register tile shape (1 to 8 rows), several tiles and blocks of rows, k in one pass, in pieces
    (K_STEP) and ending in a partial piece."""
    assert_within_an_ulp_of_the_exact_product(bf16_gemm, rows, n, k, with_bias)


@pytest.mark.parametrize("rows", [1, 17, 32, 45, 300, 600])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_gemm_within_an_ulp_of_the_exact_product(amx_gemm: NativeKernels, rows: int, n: int, k: int,
                                                     with_bias: bool) -> None:
    """One group of rows (decode), a last partial group, k = 1536 in spans whose sums wait in float32 between
    them (more than one group), and 600 rows of k = 576 in two blocks of rows."""
    assert_within_an_ulp_of_the_exact_product(amx_gemm, rows, n, k, with_bias)


def test_amx_gemm_needs_k_in_tiles(amx_gemm: NativeKernels) -> None:
    assert amx_gemm.pack_gemm_weight(torch.zeros(64, 48).bfloat16()) is None  # K = 48: not whole 32-wide tiles
    assert amx_gemm.pack_gemm_weight(torch.zeros(64, 64).bfloat16()) is not None


@pytest.mark.parametrize("width", [49152, 1000, 37, 16, 1])
def test_argmax_is_the_first_maximal_index_of_the_upcast(native: NativeKernels, width: int) -> None:
    rows = (torch.randn(9, width, generator=torch.Generator().manual_seed(width)) * 5 - 3).to(torch.bfloat16)
    rows[1] = -7.0  # every value tied: index 0
    rows[2, -1] = 1e4  # the maximum in the last element (past the last whole vector when width % 16)
    if width > 20:
        rows[3, 5] = rows[3, width - 3] = 1e4  # two maxima: the first wins
        rows[4] = -1.0
        rows[4, 17] = -0.0
        rows[4, 18] = 0.0  # -0 ties +0
    expected = rows.float().max(dim=-1).indices
    assert native.argmax(rows).tolist() == expected.tolist()


@pytest.mark.parametrize("width", [49152, 49157, 1000, 40, 7])
def test_apply_token_bitmask_masks_the_listed_rows_as_xgrammar_does(
    native: NativeKernels, width: int
) -> None:
    import xgrammar

    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(6, width, generator=generator).to(torch.bfloat16)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (6, (width + 31) // 32), dtype=torch.int32, generator=generator
    )
    bitmask[0] = -1  # every token allowed: the row stays as it is
    bitmask[1] = 0  # no token allowed: the whole row, tail included, is -inf
    rows = [0, 1, 3, 5]  # rows 2 and 4 are unconstrained: untouched whatever their bitmask says
    expected, masked = logits.clone(), logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    native.apply_token_bitmask(masked, bitmask, rows)
    assert torch.equal(masked, expected)
    allowed = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = allowed.reshape(6, -1)[:, :width].bool()
    for row in range(6):
        kept = allowed[row] if row in rows else torch.ones(width, dtype=torch.bool)
        assert torch.equal(masked[row][kept], logits[row][kept])
        assert torch.isneginf(masked[row][~kept]).all()
    assert torch.isneginf(masked[1]).all() and torch.equal(masked[0], logits[0])
