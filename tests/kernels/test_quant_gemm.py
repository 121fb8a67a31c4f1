"""quant_gemm.c (quantized weights used as stored) against a reference computed the same way in float64, for
every weight format and each ISA level this CPU can run: AVX2's vpmaddubsw dot products at "avx2" and
"avx512" (x86-64-v4 has no VNNI), VNNI's vpdpbusd where the CPU's own level has it and at "avx512_bf16" and
"amx" (every CPU with AVX512-BF16 has AVX512-VNNI); and the batch paths of quant_panel_gemm.c: bfloat16 panels,
and int8 weights with int8 activations (w8a8_panel_gemm.c) at "avx512_bf16", and in float32 on AVX2 vectors
(w8a8_f32_gemm.c) at "avx2"."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ember.kernels.build import compiler
from ember.kernels.cpu import ISA_LEVELS, cpu_flags, cpu_isa_level, level_at_least
from ember.kernels.native import load_native_kernels
from ember.kernels.quant_gemm import AVX2_W8A8_GEMV_MAX_ROWS, GEMV_MAX_ROWS, PANEL_GEMV_MAX_ROWS, QuantGemm
from ember.kernels.quantized_weight import (
    BLOCK,
    BLOCK_MIN_FORMATS,
    W8A8_GROUP,
    QuantizedWeight,
    cat_rows,
    int8_panels,
)

LEVELS = [level for level in ISA_LEVELS[1:] if level_at_least(cpu_isa_level(), level)]
# "q4_k+q6_k": Q4_K rows fused with Q6_K ones (a Q4_K_M file's q, k and v), one q6_k weight with mins; "q5_1+q8_0":
# Q5_1 rows fused with Q8_0 ones (a Q5_K_M file's), one q8_0_min weight
FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_k+q6_k", "q5_1+q8_0", "int8")
N, K = 96, 576  # 18 blocks per row: two whole groups of 8 for the GEMV, then one ending at block 18 (6 masked)
ODD_K = 13 * BLOCK  # a group of 8, then a partial group of 5 (a lone last block of Q4 nibbles and Q5 masks)
K_QUANT_WIDTHS = {K: 512, ODD_K: 768}  # q4_k and q6_k rows are whole super-blocks of 256 (one GEMV group each)
# GGUF block type, bytes per super-block and the offset of its fp16 scales (d, and dmin for Q4_K)
K_QUANTS = {"q4_k": ("Q4_K", 144, 0, 2), "q5_k": ("Q5_K", 176, 0, 2), "q6_k": ("Q6_K", 210, 208, 1)}
FUSED = {"q4_k+q6_k": "q6_k", "q5_1+q8_0": "q8_0_min"}  # the fused weight's format


def width(format: str, k: int = K) -> int:
    """The row width a test uses for `format` where others use k."""
    return K_QUANT_WIDTHS[k] if format in (*K_QUANTS, "q4_k+q6_k") else k


@pytest.fixture(scope="module", params=LEVELS or [pytest.param("none", marks=pytest.mark.skip("no AVX2"))])
def kernels(request: pytest.FixtureRequest) -> QuantGemm:
    if compiler() is None:
        pytest.skip("no C compiler")
    return QuantGemm(request.param)


def random_weight(format: str, seed: int, k: int = K) -> tuple[QuantizedWeight, torch.Tensor]:
    """A weight [N, k] of `format` made from random floats, and its float32 values as gguf's own dequantizer
    (or, for int8, the definition) gives them."""
    generator = torch.Generator().manual_seed(seed)
    if format in FUSED:
        parts = [random_weight(part, seed + i, k) for i, part in enumerate(format.split("+"))]
        fused = cat_rows([weight.map_rows(lambda rows: rows[: N // 2]) for weight, _ in parts], torch.float32)
        assert isinstance(fused, QuantizedWeight) and fused.format == FUSED[format]
        return fused, torch.cat([dense[: N // 2] for _, dense in parts])
    if format in K_QUANTS:  # gguf cannot quantize to them: random super-blocks (any bytes, small fp16 scales)
        block_type, block_bytes, at, count = K_QUANTS[format]
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, (N, k // 256, block_bytes), dtype=np.uint8)
        floats = (rng.random((N, k // 256, count)) * 0.02).astype(np.float16)
        blocks[:, :, at : at + 2 * count] = floats.view(np.uint8).reshape(N, k // 256, 2 * count)
        raw = blocks.reshape(N, -1)
        dense = dequantize(raw, GGMLQuantizationType[block_type]).reshape(N, k).astype(np.float32)
        return QuantizedWeight.from_gguf_blocks(block_type, raw, N), torch.from_numpy(dense)
    dense = torch.randn(N, k, generator=generator) * torch.rand(N, 1, generator=generator)
    if format == "int8":
        weight = QuantizedWeight.int8_per_channel(dense)
        return weight, weight.scales[:, None] * weight.values.float()
    block_type = GGMLQuantizationType[format.upper()]
    blocks = quantize(dense.numpy(), block_type)
    return (
        QuantizedWeight.from_gguf_blocks(format.upper(), blocks, N),
        torch.from_numpy(dequantize(blocks, block_type).reshape(N, k).astype(np.float32)),
    )


def reference(x: torch.Tensor, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T, bound): the activations quantized as quant_gemm.c does (float32: d = max|x| / 127, round half
    to even of x * (1 / d)), each block's integer dot product exact, its scales applied and the blocks summed
    in float64; bound = 1e-5 x the sum of the blocks' absolute contributions (float32 accumulation)."""
    rows = x.shape[0]
    blocks = x.view(rows, -1, BLOCK)
    d = blocks.abs().amax(dim=2) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    xq = torch.round(blocks * inverse[:, :, None])
    xs = (d * xq.sum(dim=2)).double()
    d = d.double()
    n = weight.shape[0]
    if weight.format == "q6_k":  # a scale per 16 weights within the activations' blocks of 32, a min per 32
        halves = torch.einsum("rbhi,nbhi->rnbh", xq.double().view(rows, -1, 2, 16),
                              weight.values.view(n, -1, 2, 16).double())
        half_scales, mins = (t.double() for t in weight.block_scales_and_mins())
        terms = (halves * half_scales.view(n, -1, 2)[None]).sum(dim=3) * d[:, None, :] + mins[None] * xs[:, None, :]
        return terms.sum(dim=2), 1e-5 * terms.abs().sum(dim=2)
    if weight.format in ("q8_0", "q8_0_min", "int8"):
        q = weight.values.view(n, -1, BLOCK).double()
    else:
        q = weight.block_values().double()
    dots = torch.einsum("rbi,nbi->rnb", xq.double(), q)  # exact: small integers
    if weight.format == "int8":
        terms = dots * d[:, None, :] * weight.scales.double()[None, :, None]
    else:
        with_mins = weight.format in (*BLOCK_MIN_FORMATS, "q4_k", "q5_k")
        scales, mins = weight.block_scales_and_mins() if with_mins else (weight.scales, None)
        dw = scales.double()[None]
        terms = dw * d[:, None, :] * dots
        if weight.format in ("q4_0", "q5_0"):
            terms = terms - (8 if weight.format == "q4_0" else 16) * dw * xs[:, None, :]
        if mins is not None:
            terms = terms + mins.double()[None] * xs[:, None, :]
    return terms.sum(dim=2), 1e-5 * terms.abs().sum(dim=2)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, GEMV_MAX_ROWS])
@pytest.mark.parametrize("k", [K, ODD_K])
def test_gemm_matches_the_same_math_in_float64(kernels: QuantGemm, format: str, rows: int, k: int) -> None:
    k = width(format, k)
    weight, _ = random_weight(format, seed=rows, k=k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)) * 3
    x[0, :BLOCK] = 0  # an all-zero block: scale 0, no division by it
    expected, bound = reference(x, weight)
    got = kernels.gemm(x, weight).double()
    assert got.shape == (rows, N)
    assert bool(((got - expected).abs() <= bound).all()), (got - expected).abs().max()


@pytest.mark.parametrize("format", FORMATS)
def test_bfloat16_rows_and_bias(kernels: QuantGemm, format: str) -> None:
    """bfloat16 in and out: the same math on the bfloat16 values, the bias added and the sum rounded to
    bfloat16 once (within half a bfloat16 step of the float64 result, beyond the float32 bound)."""
    weight, _ = random_weight(format, seed=3, k=width(format))
    x = torch.randn(6, width(format), generator=torch.Generator().manual_seed(5)).bfloat16()
    bias = torch.randn(N, generator=torch.Generator().manual_seed(6)).bfloat16()
    expected, bound = reference(x.float(), weight)
    expected = expected + bias.double()
    got = kernels.gemm(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (6, N)
    assert bool(((got.double() - expected).abs() <= bound + expected.abs() * 2**-8).all())


@pytest.mark.parametrize("format", FORMATS)
def test_dequantize_matches_gguf(kernels: QuantGemm, format: str) -> None:
    weight, dense = random_weight(format, seed=7, k=width(format))
    assert torch.allclose(kernels.dequantize(weight), dense, rtol=1e-6, atol=0)
    assert torch.equal(kernels.dequantize(weight, torch.bfloat16), kernels.dequantize(weight).bfloat16())
    assert torch.allclose(weight.dequantize(), dense, rtol=1e-6, atol=0)


@pytest.mark.parametrize("format", FORMATS)
def test_linear_switches_to_the_dequantized_gemm_past_the_decode_rows(
    kernels: QuantGemm, format: str
) -> None:
    weight, dense = random_weight(format, seed=11, k=width(format))
    bias = torch.randn(N)
    x = torch.randn(GEMV_MAX_ROWS + 1, width(format))
    assert torch.allclose(kernels.linear(x, weight, bias), x @ dense.T + bias, rtol=1e-4, atol=1e-4)
    # Decode rows: the quantized activations cost about 1% of the output's scale.
    decode = kernels.linear(x[:2], weight, bias)
    assert decode.dtype == torch.float32
    error = (decode - (x[:2] @ dense.T + bias)).abs().max()
    assert error <= 0.02 * (x[:2] @ dense.T).abs().max(), error
    assert kernels.linear(x[:2].bfloat16(), weight, None).dtype == torch.bfloat16


PANEL_LEVELS = [level for level in ("amx", "avx512_bf16") if level_at_least(cpu_isa_level(), level)]


@pytest.mark.parametrize("level", PANEL_LEVELS)
@pytest.mark.parametrize("format", FORMATS)
def test_panels_equal_the_bfloat16_gemm_on_the_dequantized_weight(level: str, format: str) -> None:
    """quant_panel_gemm.c dequantizes panels as dequantize_weight does and runs the bfloat16 GEMM's own tiles: bit
    for bit the native GEMM on the weight dequantized to bfloat16, at row counts with and without a tail of a
    GEMM's row group, and the linear() batches past the GEMV's rows take it."""
    if compiler() is None:
        pytest.skip("no C compiler")
    kernels = QuantGemm(level)
    native = load_native_kernels(level, torch.device("cpu"), torch.bfloat16, (N, K), 32, 1)
    assert kernels.panel_gemm_name == level and native.gemm_name == level
    assert kernels.w8a8_name == {"amx": "w8a8_amx", "avx512_bf16": "w8a8_vnni"}[level]
    if format == "int8" and kernels.panel_w8a8:
        pytest.skip("int8 weights run W8A8 here: test_w8a8_panels_compute_the_same_math")
    weight, dense = random_weight(format, seed=5, k=width(format))
    packed = native.pack_gemm_weight(kernels.dequantize(weight, torch.bfloat16))
    bias = torch.randn(N).bfloat16()
    for rows in (1, PANEL_GEMV_MAX_ROWS + 1, 32, 45, 100):
        x = torch.randn(rows, width(format)).bfloat16()
        expected = native.gemm(x, packed, bias)
        assert torch.equal(kernels.panel_gemm(x, weight, bias), expected), rows
        exact = x.float() @ dense.T + bias.float()  # only the weights' rounding to bfloat16 and the sums differ
        assert (expected.float() - exact).abs().max() <= 0.01 * exact.abs().max(), rows
        if rows > PANEL_GEMV_MAX_ROWS:
            assert torch.equal(kernels.linear(x, weight, bias), expected), rows


def w8a8_reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """w8a8_panel_gemm.c's math: x quantized per row and group of 64 (s = max|x| / 127, round half to even of
    x * (1 / s)), each group's dot product with w + 128 exact, then in float32 and its order: the groups' scaled
    sums, less the sum of s * 128 * sum(q), times the row's weight scale, plus bias, rounded to bfloat16."""
    rows, k = x.shape
    groups = x.float().view(rows, k // W8A8_GROUP, W8A8_GROUP)
    s = groups.abs().amax(dim=2) / 127.0
    q = torch.round(groups * torch.where(s != 0, 1.0 / s, torch.zeros_like(s))[:, :, None])
    unsigned = weight.values.double().view(-1, k // W8A8_GROUP, W8A8_GROUP) + 128
    dots = torch.einsum("rgi,ngi->rng", q.double(), unsigned).float()  # exact: below 2^24
    total, offset = torch.zeros(rows, weight.shape[0]), torch.zeros(rows)
    for g in range(k // W8A8_GROUP):
        total = total + dots[:, :, g] * s[:, g : g + 1]
        offset = offset + s[:, g] * (128 * q[:, g].sum(dim=1))
    y = (total - offset[:, None]) * weight.scales[None, :]
    return (y if bias is None else y + bias.float()).bfloat16()


@pytest.mark.parametrize("level", PANEL_LEVELS)
@pytest.mark.parametrize("k", [K, 1536])
def test_w8a8_panels_compute_the_same_math(level: str, k: int) -> None:
    """int8 weights of whole groups of 64 run with int8 activations, on VNNI ("avx512_bf16") or AMX's int8 tiles:
    bit for bit the reference, at row counts with and without a tail of a tile (6 rows on VNNI, 16 on AMX),
    with and without bias, from linear() past the GEMV's rows too; activations with outliers (a heavy tail) stay
    within 2% of the float product."""
    if compiler() is None:
        pytest.skip("no C compiler")
    kernels = QuantGemm(level)
    generator = torch.Generator().manual_seed(3)
    weight = QuantizedWeight.int8_per_channel(torch.randn(N, k, generator=generator))
    bias = torch.randn(N, generator=generator).bfloat16()
    for rows in (PANEL_GEMV_MAX_ROWS + 1, 6, 13, 16, 32, 33, 100):
        x = (torch.randn(rows, k, generator=generator) * torch.rand(rows, k, generator=generator).pow(4) * 8).bfloat16()
        for b in (bias, None):
            got = kernels.panel_gemm(x, weight, b)
            assert torch.equal(got, w8a8_reference(x, weight, b)), (rows, b is None)
        assert torch.equal(kernels.linear(x, weight, bias), kernels.panel_gemm(x, weight, bias))
        exact = x.float() @ weight.dequantize().T
        assert (kernels.panel_gemm(x, weight, None).float() - exact).abs().max() <= 0.02 * exact.abs().max(), rows


def w8a8_f32_reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """w8a8_f32_gemm.c's math in float64: x quantized as w8a8_reference's, each group's dot product with the
    signed weights exact, scaled by the group's s and summed, times the row's weight scale, plus bias."""
    rows, k = x.shape
    groups = x.view(rows, k // W8A8_GROUP, W8A8_GROUP)
    s = groups.abs().amax(dim=2) / 127.0
    q = torch.round(groups * torch.where(s != 0, 1.0 / s, torch.zeros_like(s))[:, :, None])
    dots = torch.einsum("rgi,ngi->rng", q.double(), weight.values.double().view(-1, k // W8A8_GROUP, W8A8_GROUP))
    y = (dots * s.double()[:, None, :]).sum(dim=2) * weight.scales.double()[None, :]
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("k", [K, 1536])
def test_w8a8_in_float32_on_avx2_computes_the_same_math(k: int) -> None:
    """At "avx2", int8_panels weights run float32 rows with int8 activations (vpmaddubsw on |q| and the weights
    carrying q's sign): the float64 reference of the same math within float32's rounding, at row counts with
    and without a tail of the 4-row tile, with and without bias, from linear() too; a heavy tail of activations
    stays within 2% of the float product. Linears with an int8 copy leave the GEMV past 4 rows."""
    if compiler() is None or "avx2" not in LEVELS:
        pytest.skip("no C compiler or no AVX2")
    kernels = QuantGemm("avx2")
    assert kernels.w8a8_name == "w8a8_avx2" and kernels.runs_w8a8(torch.float32)
    assert not kernels.runs_w8a8(torch.bfloat16)
    assert kernels.gemv_max_rows(torch.float32, beside_int8=True) == AVX2_W8A8_GEMV_MAX_ROWS
    assert kernels.gemv_max_rows(torch.float32) == GEMV_MAX_ROWS
    generator = torch.Generator().manual_seed(3)
    weight = QuantizedWeight.int8_per_channel(torch.randn(N, k, generator=generator))
    panels = int8_panels(weight)
    bias = torch.randn(N, generator=generator)
    for rows in (1, 3, 4, 5, 17, 33, 100):
        x = torch.randn(rows, k, generator=generator) * torch.rand(rows, k, generator=generator).pow(4) * 8
        for b in (bias, None):
            got = kernels.gemm(x, panels, b)
            expected = w8a8_f32_reference(x, weight, b)
            assert got.dtype == torch.float32
            assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max(), (rows, b is None)
        assert torch.equal(kernels.linear(x, panels, bias), kernels.gemm(x, panels, bias))
        exact = x @ weight.dequantize().T
        assert (kernels.gemm(x, panels, None) - exact).abs().max() <= 0.02 * exact.abs().max(), rows
    with pytest.raises(ValueError, match="float32 on AVX2"):
        kernels.gemm(torch.randn(2, k).bfloat16(), panels)
    assert not kernels.panel_w8a8  # bfloat16 panels need AMX or AVX512-BF16: refused, not left unwritten
    with pytest.raises(ValueError, match="no bfloat16 panels"):
        kernels.panel_gemm(torch.randn(2, k).bfloat16(), panels)


@pytest.mark.parametrize("level", PANEL_LEVELS)
def test_int8_panels_hold_the_int8_weight_laid_out_for_w8a8(level: str) -> None:
    """The weight re-laid out once at load (--quantization auto's batches) gives the int8 weight's results at
    every row count (the GEMV's included: int8_panels always runs W8A8) and dequantizes to the same values."""
    if compiler() is None:
        pytest.skip("no C compiler")
    kernels = QuantGemm(level)
    weight = QuantizedWeight.int8_per_channel(torch.randn(N, K, generator=torch.Generator().manual_seed(4)))
    panels = int8_panels(weight)
    assert panels.shape == weight.shape and torch.equal(panels.dequantize(), weight.dequantize())
    bias = torch.randn(N).bfloat16()
    for rows in (1, 4, 7, 64):
        x = torch.randn(rows, K).bfloat16()
        assert torch.equal(kernels.linear(x, panels, bias), kernels.panel_gemm(x, weight, bias)), rows
    with pytest.raises(ValueError, match="panel_gemm only"):
        kernels.gemm(torch.randn(2, K), panels)


@pytest.mark.parametrize("level", PANEL_LEVELS)
def test_int8_weights_of_partial_groups_take_bfloat16_panels(level: str) -> None:
    """A width that is not whole groups of 64 (13 x 32) keeps the bfloat16 panels: the native GEMM's result on
    the dequantized weight."""
    if compiler() is None:
        pytest.skip("no C compiler")
    kernels = QuantGemm(level)
    native = load_native_kernels(level, torch.device("cpu"), torch.bfloat16, (N, ODD_K), 32, 1)
    weight, _ = random_weight("int8", seed=8, k=ODD_K)
    x = torch.randn(20, ODD_K).bfloat16()
    expected = native.gemm(x, native.pack_gemm_weight(kernels.dequantize(weight, torch.bfloat16)), None)
    assert torch.equal(kernels.panel_gemm(x, weight, None), expected)


def test_the_cpus_own_level_uses_vnni_where_it_has_it(kernels: QuantGemm) -> None:
    vnni = {"avx512_vnni", "avx_vnni"} & cpu_flags() and kernels.level == cpu_isa_level()
    vnni = vnni or kernels.level in ("avx512_bf16", "amx")  # built with -mavx512vnni
    assert kernels.dot_product == ("vnni" if vnni else "avx2_maddubs")


def test_int8_per_channel_round_trips_within_half_a_step() -> None:
    dense = torch.randn(N, K)
    weight = QuantizedWeight.int8_per_channel(dense)
    assert weight.values.dtype == torch.int8 and weight.values.abs().max() == 127
    assert bool(((weight.dequantize() - dense).abs() <= weight.scales[:, None] / 2 + 1e-7).all())
