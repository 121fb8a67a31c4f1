"""ember's float32 kernels (paged_attention_f32.c, fused_ops_f32.c, f32_gemm.c) against exact or PyTorch results,
built for each ISA level this CPU can run: AVX2 + FMA vectors at "avx2", AVX-512 ones from "avx512" up."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.build import compiler
from ember.kernels.cpu import ISA_LEVELS, cpu_isa_level, level_at_least
from ember.kernels.native import NativeKernels, kernel_paths, load_native_kernels
from ember.layers.attention import PagedAttention, SequenceSpan, build_attention_metadata
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from tests.kernels.test_native_kernels import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    exact_chunk_attention,
    scrambled_paged_cache,
)

CPU = torch.device("cpu")
LEVELS = [level for level in ISA_LEVELS[1:] if level_at_least(cpu_isa_level(), level)]
# float32 products summed in another order: a few float32 ulps of the largest magnitude involved.
RELATIVE = 2e-6


@pytest.fixture(scope="module", params=LEVELS or [pytest.param("none", marks=pytest.mark.skip("no AVX2"))])
def native(request: pytest.FixtureRequest) -> NativeKernels:
    if compiler() is None:
        pytest.skip("no C compiler")
    kernels = load_native_kernels(request.param, CPU, torch.float32, (576, 1536), HEAD_DIM, HEADS // KV_HEADS)
    assert kernels.level == request.param and kernels.dtype == torch.float32
    return kernels


def test_paths_are_the_vector_width_of_the_level(native: NativeKernels) -> None:
    vector = "native_avx512" if level_at_least(native.level, "avx512") else "native_avx2"
    gemm = f"{vector} (every row count in the decoder stack; op by op up to 32 rows, else torch)"
    stack = f"{vector} (steps of up to 64 rows, else op by op)"
    assert kernel_paths(native) == {"gemm": gemm, "attention_decode": vector, "attention_prefill": vector,
                                    "fused_ops": vector, "decoder_stack": stack}


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((got.double() - expected.double()).abs().max() <= expected.abs().max() * RELATIVE)


# Decode batches (1-7 rows: one register tile and its tails at both vector widths), a block of prompt rows and
# more than one (256: several row blocks and a tail).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 32, 73, 256])
@pytest.mark.parametrize(("n", "k", "with_bias"), [(960, 576, True), (96, 1536, False)])
def test_gemm_matches_exact_linear(native: NativeKernels, rows: int, n: int, k: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows + n)
    weight = torch.randn(n, k, generator=generator) * 0.05
    bias = torch.randn(n, generator=generator) if with_bias else None
    x = torch.randn(rows, 2 * k, generator=generator)[:, :k]  # rows with a stride of 2 K, a slice of a wider tensor
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    out = native.gemm(x, native.pack_gemm_weight(weight), bias)
    # float32 sums of k products in any order: within k float32 ulps of the sum of the products' magnitudes.
    bound = (x.abs().double() @ weight.abs().double().T + (0 if bias is None else bias.abs().double())) * k * 2**-24
    assert ((out.double() - exact).abs() <= bound).all()
    assert (out.double() - exact).abs().max() <= exact.abs().max() * RELATIVE
    assert torch.equal(native.gemm(x.contiguous(), native.pack_gemm_weight(weight), bias), out)
    assert native.pack_gemm_weight(torch.zeros(48, k)) is None  # 48 outputs: not whole 32-wide panels


def test_add_rms_norm(native: NativeKernels) -> None:
    torch.manual_seed(0)
    weight = torch.rand(576) + 0.5
    x, residual = torch.randn(37, 576), torch.randn(37, 576)
    expected_residual = x + residual
    expected = torch.nn.functional.rms_norm(expected_residual, (576,), weight, 1e-5)
    out, new_residual = native.add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual.data_ptr() == residual.data_ptr() and torch.equal(new_residual, expected_residual)
    assert close(out, expected)
    first, first_residual = native.add_rms_norm(x, None, weight, 1e-5)
    assert first_residual is x and close(first, torch.nn.functional.rms_norm(x, (576,), weight, 1e-5))


def test_silu_and_mul(native: NativeKernels) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(45, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert close(native.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("width", [49152, 1000, 37, 16, 1])
def test_argmax_is_the_first_maximal_index(native: NativeKernels, width: int) -> None:
    rows = torch.randn(9, width, generator=torch.Generator().manual_seed(width)) * 5 - 3
    rows[1] = -7.0  # every value tied: index 0
    rows[2, -1] = 1e4  # the maximum in the last element (past the last whole vector when width % LANES)
    if width > 20:
        rows[3, 5] = rows[3, width - 3] = 1e4  # two maxima: the first wins
        rows[4] = -1.0
        rows[4, 17] = -0.0
        rows[4, 18] = 0.0  # -0 ties +0
    assert native.argmax(rows).tolist() == rows.max(dim=-1).indices.tolist()


def test_rotary_and_cache(native: NativeKernels) -> None:
    torch.manual_seed(2)
    cos, sin = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None, torch.float32, CPU)(torch.randint(0, 4096, (21,)))
    qkv = torch.randn(21, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk_size = (HEADS + KV_HEADS) * HEAD_DIM
    expected_qk = apply_rotary(qkv[:, :qk_size].view(21, -1, HEAD_DIM), cos, sin).reshape(21, -1)
    v = qkv[:, qk_size:].clone()
    cache = torch.zeros(8, BLOCK, 2, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(8 * BLOCK)[:21]
    native.rotary_and_cache(qkv, cos, sin, slots, cache, HEADS)
    assert close(qkv[:, :qk_size], expected_qk) and torch.equal(qkv[:, qk_size:], v)
    written = cache.view(-1, 2, KV_HEADS * HEAD_DIM)[slots]
    assert torch.equal(written[:, 0], qkv[:, HEADS * HEAD_DIM : qk_size]) and torch.equal(written[:, 1], v)


@pytest.mark.parametrize("chunks", [
    [(0, 1), (14, 1), (15, 1), (16, 1), (199, 1), (332, 1)],  # decodes: (tokens cached, 1 new)
    [(0, 2), (0, 17), (5, 40), (33, 16), (100, 37), (190, 64)],  # prompt chunks
])
def test_paged_attention_matches_exact_attention(native: NativeKernels, chunks: list[tuple[int, int]]) -> None:
    tables, cache = scrambled_paged_cache([cached + new for cached, new in chunks], seed=3)
    cache = cache.float()
    spans = [SequenceSpan(cached, new, table) for (cached, new), table in zip(chunks, tables, strict=True)]
    qkv = torch.randn(sum(new for _, new in chunks), (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k, v = qkv.split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=1)
    q, k, v = q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)
    meta = build_attention_metadata(spans, BLOCK, torch.float32, CPU, native)
    assert [group.context_lens is not None for group in meta.groups] == [True]
    out = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)(q, k, v, cache, meta)
    for row, case, exact in exact_chunk_attention(q, cache, chunks, tables):
        assert close(out[row], exact), case
