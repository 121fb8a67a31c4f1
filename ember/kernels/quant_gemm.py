"""quant_gemm.c on torch tensors: a Linear's quantized weight (QuantizedWeight) used without dequantizing it.

Batches of up to GEMV_MAX_ROWS rows (decode steps) run quant_gemm.c's integer dot products on the blocks as
stored; larger ones (prompt chunks), where the arithmetic outweighs reading the weight, dequantize the
weight into a float32 scratch and multiply with PyTorch's GEMM (oneDNN)."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ember.errors import EmberError
from ember.kernels.build import KernelBuildError, bind, load_kernel
from ember.kernels.cpu import cpu_isa_level, kernel_level, level_at_least
from ember.kernels.quantized_weight import QuantizedWeight

_pointer, _int64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "int8": 3}  # quant_gemm.c's enum weight_format
_DESCRIPTOR_FIELDS = 7  # quant_gemm.c's quant_linear: seven 8-byte fields
# The most rows quant_gemm takes: past it the float GEMM on the dequantized weight is faster
# (docs/benchmarks.md, issue 14).
GEMV_MAX_ROWS = 16


class QuantGemm:
    """quant_gemm.c built for ISA `level` (at least "avx2"); `dot_product` names the instruction it uses."""

    def __init__(self, level: str) -> None:
        self.level = level
        library = load_kernel("quant_gemm.c", (), level)
        self.dot_product = "vnni" if library.quant_gemm_uses_vnni() else "avx2_maddubs"
        self._gemm = bind(
            library,
            "quant_gemm",
            _int,
            _pointer,
            _int,
            _int64,
            _int64,
            _pointer,
            _pointer,
            _pointer,
            _pointer,
            _pointer,
            _int64,
            _int64,
            _int,
        )
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

    def linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, K] @ W^T + bias -> [rows, N] in x's dtype."""
        if x.shape[0] > GEMV_MAX_ROWS:
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
        rows, k = x.shape
        n = weight.shape[0]
        if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1 or k != weight.shape[1]:
            raise ValueError(
                f"quantized GEMM needs float32 or bfloat16 x [rows, {weight.shape[1]}] with unit stride over K, "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            raise ValueError(
                f"quantized GEMM needs a contiguous bias of x's dtype {x.dtype}, got {bias.dtype}"
            )
        out = torch.empty(rows, n, dtype=x.dtype)
        self._gemm(
            _FORMAT_CODES[weight.format],
            x.data_ptr(),
            x.dtype == torch.bfloat16,
            x.stride(0),
            rows,
            weight.values.data_ptr(),
            weight.scales.data_ptr(),
            tensor_address(weight.mins),
            tensor_address(bias),
            out.data_ptr(),
            n,
            k,
            torch.get_num_threads(),
        )
        return out

    def descriptors(self, weights: list[QuantizedWeight], max_rows: int) -> LinearDescriptors:
        """quant_gemm.c's quant_linear for each of `weights`, all sharing one activation scratch for up to
        `max_rows` rows (for decoder_stack_quant.c: its Linears run one after another)."""
        max_k = max(weight.shape[1] for weight in weights)
        scratch = torch.empty(self._scratch_bytes(max_rows, max_k), dtype=torch.uint8)
        table = torch.empty(len(weights), _DESCRIPTOR_FIELDS, dtype=torch.int64)
        for row, weight in zip(table, weights, strict=True):
            self._init_descriptor(
                row.data_ptr(),
                _FORMAT_CODES[weight.format],
                weight.values.data_ptr(),
                weight.scales.data_ptr(),
                tensor_address(weight.mins),
                scratch.data_ptr(),
                max_rows,
                max_k,
            )
        return LinearDescriptors(table, scratch, max_rows)

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as [N, K] of `dtype` (float32 or bfloat16; others through float32)."""
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
    """quant_linear structs (rows of `table`, in order) and the activation scratch they point to, which holds
    up to `max_rows` rows (the tensors they point to must outlive them)."""

    table: torch.Tensor
    scratch: torch.Tensor
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
