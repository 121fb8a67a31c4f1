"""quant_gemm.c on torch tensors: a Linear's quantized weight (QuantizedWeight) used without dequantizing it.

Decode-sized batches run quant_gemm.c's integer dot products on the blocks as stored (the GEMV). Larger ones,
where the arithmetic outweighs reading the weight: in bfloat16 on a CPU with AMX or AVX512-BF16,
quant_panel_gemm.c dequantizes the weight a 32-output panel at a time into cache for the bfloat16 GEMM's
tiles; otherwise the weight is dequantized whole for PyTorch's GEMM (oneDNN)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ember.errors import EmberError
from ember.kernels.build import KernelBuildError, bind, load_kernel
from ember.kernels.cpu import cpu_isa_level, kernel_level, level_at_least
from ember.kernels.native import ANY_ROWS
from ember.kernels.quantized_weight import QuantizedWeight

_pointer, _int64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_FORMAT_CODES = {  # quant_gemm.c's enum weight_format
    "q8_0": 0, "q4_0": 1, "q4_1": 2, "int8": 3, "int8_panels": 4, "q4_k": 5, "q6_k": 6, "q5_0": 7, "q5_1": 8, "q5_k": 9,
    "q8_0_min": 10,
}
_DESCRIPTOR_FIELDS = 8  # quant_gemm.c's quant_linear: eight 8-byte fields
# The most rows the GEMV takes: past them the float GEMM on the dequantized weight is faster, and with bfloat16
# panels already past PANEL_GEMV_MAX_ROWS (docs/benchmarks.md, issue 14).
GEMV_MAX_ROWS = 16
PANEL_GEMV_MAX_ROWS = 4
# On AVX2, float32 batches of more rows than this run on int8 copies of the weights (w8a8_f32_gemm.c) rather than
# on the blocks' GEMV, where a Linear holds both: faster from 3 rows on a Zen 3, and from 4 as with bfloat16's
# panels (PANEL_GEMV_MAX_ROWS), so that a few requests decode alike together and apart (docs/benchmarks.md).
AVX2_W8A8_GEMV_MAX_ROWS = 4
# The most rows for which AMX's int8 tiles (w8a8_panel_gemm.c: a tile store and a float32 rescale per group of
# 64) beat the bfloat16 tiles; with VNNI int8 activations are faster at every row count (docs/benchmarks.md).
AMX_W8A8_MAX_ROWS = 64


class QuantGemm:
    """quant_gemm.c (with quant_panel_gemm.c) built for ISA `level` (at least "avx2"); `dot_product` names the
    GEMV's instruction, `panel_gemm_name` the bfloat16 GEMM of the panels (None without AMX or AVX512-BF16)."""

    def __init__(self, level: str) -> None:
        self.level = level
        library = load_kernel("quant_panel_gemm.c", (), level)
        self.dot_product = "vnni" if library.quant_gemm_uses_vnni() else "avx2_maddubs"
        # bfloat16 tiles on dequantized panels for batches (AMX or AVX512-BF16), or None.
        self.panel_gemm_name = (
            ("amx" if level_at_least(level, "amx") else "avx512_bf16") if library.quant_panel_gemm_supported() else None
        )
        # Where int8 weights past the GEMV run with int8 activations rather than on bfloat16 panels
        # (w8a8_panel_gemm.c) or float32 weights (on AVX2, whose float32 GEMM has half AVX-512's lanes:
        # w8a8_f32_gemm.c): the kernel's name, or None.
        self.w8a8_name = {0: None, 1: "w8a8_vnni", 2: "w8a8_amx"}[library.quant_panel_gemm_w8a8()]
        if level == "avx2":
            self.w8a8_name = "w8a8_avx2"
        # The most rows int8_panels weights should take (they take any number).
        self.w8a8_max_rows = AMX_W8A8_MAX_ROWS if self.w8a8_name == "w8a8_amx" else ANY_ROWS
        # (format, x, [x_bf16,] x_stride, rows, qs, scales, mins, bias, out, n, k, threads): the panels take bfloat16 x only.
        after_x = (_int64, _int64, *(_pointer,) * 5, _int64, _int64, _int)
        self._panel_gemm = bind(library, "quant_panel_gemm", _int, _pointer, *after_x)
        self._gemm = bind(library, "quant_gemm", _int, _pointer, _int, *after_x)
        self._scratch_bytes = library.quant_linear_scratch_bytes
        self._scratch_bytes.argtypes, self._scratch_bytes.restype = [_int64, _int64], _int64
        self._init_descriptor = bind(
            library, "quant_linear_init", _pointer, _int, _pointer, _pointer, _pointer, _pointer, _int64, _int64
        )
        self._dequantize = bind(
            library,
            "dequantize_weight",
            _int,
            _pointer,
            _pointer,
            _pointer,
            _pointer,
            _int,
            _int64,
            _int64,
            _int,
        )

    @property
    def panel_w8a8(self) -> bool:
        """Whether int8 weights past the GEMV run with int8 activations on the bfloat16 panels' path
        (panel_gemm: VNNI or AMX)."""
        return self.w8a8_name in ("w8a8_vnni", "w8a8_amx")

    def runs_w8a8(self, dtype: torch.dtype) -> bool:
        """Whether batches of activations of `dtype` past the GEMV run int8 weights with int8 activations:
        bfloat16 on VNNI or AMX, float32 on AVX2."""
        if dtype == torch.float32:
            return self.w8a8_name == "w8a8_avx2"
        return dtype == torch.bfloat16 and self.panel_w8a8

    def gemv_max_rows(self, dtype: torch.dtype, beside_int8: bool = False) -> int:
        """The most rows linear() gives the GEMV for activations of `dtype`; `beside_int8`: for a weight that
        has an int8 copy (Linear.batch_quantized) for larger batches."""
        if beside_int8 and dtype == torch.float32 and self.runs_w8a8(dtype):
            return AVX2_W8A8_GEMV_MAX_ROWS
        return PANEL_GEMV_MAX_ROWS if self.panel_gemm_name and dtype == torch.bfloat16 else GEMV_MAX_ROWS

    def linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, K] @ W^T + bias -> [rows, N] in x's dtype."""
        if weight.format == "int8_panels" and self.runs_w8a8(torch.float32):  # any rows, float32
            return self.gemm(x.float().contiguous(), weight, None if bias is None else bias.float()).to(x.dtype)
        if weight.format == "int8_panels":  # batches only; any rows, bfloat16
            return self.panel_gemm(x.bfloat16().contiguous(), weight,
                                   None if bias is None else bias.bfloat16()).to(x.dtype)
        if x.shape[0] > self.gemv_max_rows(x.dtype):
            if self.panel_gemm_name and x.dtype == torch.bfloat16 and x.stride(1) == 1:
                return self.panel_gemm(x, weight, None if bias is None else bias.to(x.dtype))
            return F.linear(x, self.dequantize(weight, x.dtype), bias)
        if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1:
            return self.gemm(x.float().contiguous(), weight, None if bias is None else bias.float()).to(
                x.dtype
            )
        return self.gemm(x, weight, None if bias is None else bias.to(x.dtype))

    def gemm(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, K] (float32 or bfloat16, unit stride over K) @ W^T + bias (x's dtype) -> [rows, N] in x's
        dtype, the activations quantized to int8 per block of 32 first (quant_gemm.c)."""
        if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1 or x.shape[1] != weight.shape[1]:
            raise ValueError(
                f"quantized GEMM needs float32 or bfloat16 x [rows, {weight.shape[1]}] with unit stride over K, "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        if weight.format == "int8_panels" and not (x.dtype == torch.float32 and self.runs_w8a8(x.dtype)):
            raise ValueError("int8_panels weights run on panel_gemm only (the GEMV reads weights by rows), or in "
                             "float32 on AVX2")
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            raise ValueError(
                f"quantized GEMM needs a contiguous bias of x's dtype {x.dtype}, got {bias.dtype}"
            )
        return self._run(self._gemm, x, weight, bias, x.dtype == torch.bfloat16)

    def panel_gemm(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, K] (bfloat16, unit stride over K) @ W^T + bias (bfloat16) -> bfloat16 [rows, N], on
        dequantized panels of the weight with bfloat16 tiles (quant_panel_gemm.c; panel_gemm_name not None)."""
        if self.panel_gemm_name is None:  # the C entry point would leave `out` unwritten
            raise ValueError(f"ISA level {self.level} has no bfloat16 panels (they need AMX or AVX512-BF16)")
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"panel GEMM needs bfloat16 x [rows, {weight.shape[1]}] with unit stride over K, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if weight.format == "int8_panels" and not self.panel_w8a8:
            raise ValueError(f"int8_panels weights need the W8A8 panels, which ISA level {self.level} lacks")
        return self._run(self._panel_gemm, x, weight, bias)

    @staticmethod
    def _run(function: Callable[..., object], x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
             *x_flags: int) -> torch.Tensor:
        """function(format, x, *x_flags, x's row stride, rows, the weight's arrays, bias, out, N, K, threads)."""
        rows, k = x.shape
        n = weight.shape[0]
        out = torch.empty(rows, n, dtype=x.dtype)
        function(_FORMAT_CODES[weight.format], x.data_ptr(), *x_flags, x.stride(0), rows, weight.values.data_ptr(),
                 weight.scales.data_ptr(), tensor_address(weight.mins), tensor_address(bias), out.data_ptr(), n, k,
                 torch.get_num_threads())
        return out

    def descriptors(self, weights: list[QuantizedWeight], dtype: torch.dtype, gemv: bool = True,
                    beside_int8: bool = False) -> LinearDescriptors:
        """quant_gemm.c's quant_linear for each of `weights` with activations of `dtype`, all sharing one
        activation scratch for the GEMV's rows (for decoder_stack_quant*.c: its Linears run one after another;
        in bfloat16 with panels, it takes any number of rows). With gemv=False (bfloat16 with panels only),
        every row count runs on the panels, so that each row's values do not depend on the step's size;
        `beside_int8`: the weights have int8 copies for larger steps (gemv_max_rows)."""
        panels = self.panel_gemm_name is not None and dtype == torch.bfloat16
        if not gemv and not panels:
            raise ValueError(f"quantized weights without the GEMV need bfloat16 panels (ISA level {self.level}, {dtype})")
        gemv_rows = self.gemv_max_rows(dtype, beside_int8) if gemv else 0
        max_rows = ANY_ROWS if panels else gemv_rows
        if weights[0].format == "int8_panels":
            max_rows = self.w8a8_max_rows
        max_k = max(weight.shape[1] for weight in weights)
        scratch = torch.empty(self._scratch_bytes(gemv_rows, max_k), dtype=torch.uint8)
        table = torch.empty(len(weights), _DESCRIPTOR_FIELDS, dtype=torch.int64)
        for row, weight in zip(table, weights, strict=True):
            self._init_descriptor(
                row.data_ptr(),
                _FORMAT_CODES[weight.format],
                weight.values.data_ptr(),
                weight.scales.data_ptr(),
                tensor_address(weight.mins),
                scratch.data_ptr(),
                gemv_rows,
                max_k,
            )
        return LinearDescriptors(table, scratch, gemv_rows, max_rows)

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as [N, K] of `dtype` (float32 or bfloat16; others through float32)."""
        if weight.format == "int8_panels":  # no kernel: a load-time format, re-laid out by torch
            return weight.dequantize().to(dtype)
        n, k = weight.shape
        direct = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty(n, k, dtype=direct)
        self._dequantize(
            _FORMAT_CODES[weight.format],
            weight.values.data_ptr(),
            weight.scales.data_ptr(),
            tensor_address(weight.mins),
            out.data_ptr(),
            direct == torch.bfloat16,
            n,
            k,
            torch.get_num_threads(),
        )
        return out.to(dtype)


class LinearDescriptors(NamedTuple):
    """quant_linear structs (rows of `table`, in order) and the activation scratch they point to, for steps of
    up to `max_rows` rows, the GEMV's up to `gemv_rows` (the tensors they point to must outlive them)."""

    table: torch.Tensor
    scratch: torch.Tensor
    gemv_rows: int
    max_rows: int

    def address(self, index: int) -> int:
        return self.table.data_ptr() + index * self.table.stride(0) * self.table.element_size()


def tensor_address(tensor: torch.Tensor | None) -> int:
    """The address a C kernel takes for an optional tensor: its data, or NULL."""
    return 0 if tensor is None else tensor.data_ptr()


def load_quant_gemm(kernels: str) -> QuantGemm:
    """The quantized GEMM for `--kernels kernels` (its ISA level; auto and native: the CPU's). An EmberError
    where it cannot run: quantized weights have no PyTorch path."""
    try:
        level = kernel_level("native" if kernels == "auto" else kernels, cpu_isa_level())
    except ValueError as exc:
        raise EmberError(str(exc)) from None
    if not level_at_least(level, "avx2"):
        raise EmberError(
            f"quantized weights need ember's native kernels on an x86-64 CPU with AVX2 and FMA "
            f"(--kernels {kernels} gives ISA level {level}); use --quantization none"
        )
    try:
        return QuantGemm(level)
    except KernelBuildError as exc:
        raise EmberError(
            f"quantized weights need ember's native kernels, which cannot be built here: {exc}"
        ) from None
