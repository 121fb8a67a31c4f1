"""A Linear layer whose weight can be pre-packed once for bfloat16 on CPU: for ember's native GEMM, or for oneDNN.

`F.linear` on a plain bfloat16 weight makes oneDNN reorder the weight into its blocked (AMX/AVX512-BF16)
layout on every call; a small model streams all of its weights each step, so those reorders cost about a
third of every matmul. Packing once at load time removes them, with bit-identical results. float32 makes no
oneDNN copy: packed float32 is not faster there and rounds differently. Where the native GEMM takes every
row count (AMX in bfloat16; f32_gemm.c in float32), it replaces oneDNN and the oneDNN copy is not made.

With `--quantization gguf|int8`, the weight is a QuantizedWeight instead (GGUF blocks or int8) and `weight` is
None: forward runs quant_gemm.c on it, dequantizing only in registers. With `auto` (a GGUF file) a Linear holds
the blocks for decode-sized batches and, for larger ones, the float weight (and its packed copies) or, where
the CPU runs int8 weights with int8 activations faster than bfloat16 (AVX512-VNNI without AMX), an int8 copy
(`batch_quantized`)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import EmberError
from ember.kernels.native import ANY_ROWS, NativeKernels
from ember.kernels.quant_gemm import GEMV_MAX_ROWS, QuantGemm, load_quant_gemm
from ember.kernels.quantized_weight import BLOCK, PANEL_OUTPUTS, W8A8_GROUP, QuantizedWeight, int8_panels

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear plus optional pre-packed copies of the weight that forward uses when present: the native
    GEMM's (ember/kernels/amx_gemm.c, bf16_gemm.c or, in float32, f32_gemm.c, for batches of up to its
    gemm_max_rows), then oneDNN's; or a quantized weight and the kernels that use it."""

    packed_weight: torch.Tensor | None = None
    native: NativeKernels | None = None
    gemm_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None
    # --quantization auto where batches run W8A8: the weight as int8 per channel, for batches past the GEMV's rows.
    batch_quantized: QuantizedWeight | None = None
    quant_gemm: QuantGemm | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Hold `weight` in place of the float one (which is dropped; set quant_gemm before forward)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {tuple(weight.shape)} for a Linear of "
                             f"{(self.out_features, self.in_features)}")
        self.quantized = weight
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # With two (--quantization auto), the blocks take the GEMV's batches and the int8 (up to its most rows,
        # then the blocks' panels again) or float weight the rest.
        if self.quantized is not None:
            if x.shape[0] <= self.quant_gemm.gemv_max_rows(x.dtype, self.batch_quantized is not None):
                return self.quant_gemm.linear(x, self.quantized, self.bias)
            if self.batch_quantized is not None and x.shape[0] <= self.quant_gemm.w8a8_max_rows:
                return self.quant_gemm.linear(x, self.batch_quantized, self.bias)
            if self.weight is None:  # the panels
                return self.quant_gemm.linear(x, self.quantized, self.bias)
        if self.gemm_weight is not None and 0 < x.shape[0] <= self.native.gemm_max_rows:
            return self.native.gemm(x, self.gemm_weight, self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linear_weights(model: nn.Module) -> None:
    """Pre-pack for oneDNN every Linear of `model` that the native GEMM does not take at every row count
    (bfloat16 weights on a CPU with native bfloat16; after loading and pack_gemm_weights)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None and (
                module.gemm_weight is None or module.native.gemm_max_rows < ANY_ROWS):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)


def pack_gemm_weights(model: nn.Module, native: NativeKernels) -> None:
    """Give every Linear whose shape the native GEMM takes its re-laid-out weight (after loading)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            module.gemm_weight = native.pack_gemm_weight(module.weight.detach())


def quantize_linears_int8(model: nn.Module) -> int:
    """`--quantization int8`: every float Linear of `model` whose input width is whole blocks of 32 (the
    activations are quantized per block) takes a per-channel int8 copy of its weight; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is None and module.in_features % BLOCK == 0:
            module.set_quantized(QuantizedWeight.int8_per_channel(module.weight))
            count += 1
    return count


def attach_quant_gemm(model: nn.Module, kernels: str) -> QuantGemm | None:
    """Give every quantized Linear of `model` the quantized GEMM for `--kernels kernels`; None when there is
    none. Raises EmberError where the kernels cannot run (quantized weights have no other path)."""
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    if not quantized:
        return None
    quant_gemm = load_quant_gemm(kernels)
    for module in quantized:
        module.quant_gemm = quant_gemm
    return quant_gemm


def attach_quant_gemm_beside_floats(model: nn.Module, kernels: str, dtype: torch.dtype) -> QuantGemm | None:
    """--quantization auto: every Linear of `model` that came in quantized blocks (a GGUF file) keeps them for
    decode-sized batches (QuantGemm's GEMV: a fraction of the bytes) and takes a second weight for larger ones,
    where the arithmetic outweighs the bytes: where batches of `dtype` run int8 weights with int8 activations
    (QuantGemm.runs_w8a8: bfloat16 with VNNI or AMX, float32 on AVX2), the weight dequantized and re-quantized to
    int8 per output channel (more multiply-adds per instruction than bfloat16 or float32); elsewhere the weight
    dequantized to `dtype`, for the float GEMM. Where the quantized kernels cannot run, the blocks are dropped
    (--quantization none). The quantized GEMM, or None."""
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    if not quantized:
        return None
    try:
        quant_gemm = load_quant_gemm(kernels)
    except EmberError as exc:
        logger.info("quantization auto: the GGUF blocks are dequantized at load (%s)", exc)
        quant_gemm = None
    w8a8 = quant_gemm is not None and quant_gemm.runs_w8a8(dtype)
    block_bytes = sum(module.quantized.nbytes for module in quantized)
    for module in quantized:
        if w8a8 and module.in_features % W8A8_GROUP == 0 and module.out_features % PANEL_OUTPUTS == 0:
            module.batch_quantized = int8_panels(QuantizedWeight.int8_per_channel(module.quantized.dequantize()))
            module.weight = None
        else:
            module.weight = nn.Parameter(module.quantized.dequantize().to(dtype), requires_grad=False)
        if quant_gemm is None:
            module.quantized = None
        else:
            module.quant_gemm = quant_gemm
    if quant_gemm is not None:
        batch = [m.batch_quantized for m in quantized if m.batch_quantized is not None]
        floats = [m.weight for m in quantized if m.weight is not None]
        logger.info("quantization auto: %d Linear weights keep their blocks (%.1f MiB) for up to %d rows; larger "
                    "batches run %d on int8 copies with int8 activations (%.1f MiB) and %d on weights dequantized "
                    "to %s (%.1f MiB)", len(quantized), block_bytes / 2**20,
                    quant_gemm.gemv_max_rows(dtype, bool(batch)), len(batch), sum(w.nbytes for w in batch) / 2**20,
                    len(floats), dtype,
                    sum(w.nbytes for w in floats) / 2**20)
    return quant_gemm


def quantized_gemm_path(model: nn.Module, quant_gemm: QuantGemm, dtype: torch.dtype, float_gemm: str) -> str:
    """The kernel-path report of the GEMMs with quantized weights and activations of `dtype`: formats, ISA
    level, the GEMV's dot product and rows, and what takes larger batches (`float_gemm`: the float weights'
    path, where Linears hold both)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    formats = sorted({m.quantized.format for m in linears if m.quantized is not None})
    floats = sum(m.quantized is None for m in linears)
    w8a8 = f"int8 activations per {W8A8_GROUP} ({quant_gemm.w8a8_name})"
    beside_int8 = any(m.batch_quantized is not None for m in linears)
    if beside_int8:
        larger = f"int8 copies of the weights with {w8a8}"
        if quant_gemm.w8a8_max_rows < ANY_ROWS:
            larger += f" up to {quant_gemm.w8a8_max_rows} rows, then bfloat16 panels on {quant_gemm.panel_gemm_name}"
    elif any(m.quantized is not None and m.weight is not None for m in linears):
        larger = f"the dequantized weights on {float_gemm}"
    elif quant_gemm.panel_gemm_name is not None and dtype == torch.bfloat16:
        larger = f"bfloat16 panels on {quant_gemm.panel_gemm_name}"
        if quant_gemm.panel_w8a8 and "int8" in formats:
            larger += f", int8 weights with {w8a8}"
    else:
        larger = "dequantized + torch"
    return (f"native_quant_{quant_gemm.level} ({'+'.join(formats)}, {quant_gemm.dot_product}; up to "
            f"{quant_gemm.gemv_max_rows(dtype, beside_int8)} rows, else {larger}"
            f"{f'; {floats} float Linear(s)' if floats else ''})")


def quantized_stack_path(model: nn.Module, stack_name: str, dtype: torch.dtype, float_stack: str) -> str:
    """The kernel-path report of the decoder stack for a quantized model whose float stack is `stack_name`
    (NativeKernels.decoder_stack_name, reported as `float_stack`) and activations `dtype`: decoder_stack_quant*.c
    runs the steps (in float32, or without bfloat16 panels, those of up to GEMV_MAX_ROWS rows; where Linears
    hold float weights too, those of the GEMV's rows, the float stack the rest) where every decoder layer's Linear
    is quantized; other steps, and models with float Linears in their layers, run op by op."""
    layers = getattr(model, "layers", None)
    linears = [] if layers is None else [m for m in layers.modules() if isinstance(m, Linear)]
    if stack_name == "off" or not linears:
        return "off"
    if any(m.quantized is None for m in linears):
        return float_stack if all(m.weight is not None for m in linears) else "off"
    quant_gemm = linears[0].quant_gemm
    if all(m.batch_quantized is not None for m in linears):
        if quant_gemm.w8a8_max_rows < ANY_ROWS:
            return (f"{stack_name}_quant (every step: decode steps on the blocks up to "
                    f"{quant_gemm.gemv_max_rows(dtype, True)} rows, else the int8 copies up to "
                    f"{quant_gemm.w8a8_max_rows}; steps with prompt tokens and larger ones on the blocks' panels)")
        return (f"{stack_name}_quant (every step: the blocks up to {quant_gemm.gemv_max_rows(dtype, True)} rows, "
                f"else the int8 copies)")
    if all(m.weight is not None for m in linears):
        return f"{stack_name}_quant (steps of up to {quant_gemm.gemv_max_rows(dtype)} rows), else {float_stack}"
    if quant_gemm.panel_gemm_name is not None and dtype == torch.bfloat16:
        return f"{stack_name}_quant (every step)"
    return f"{stack_name}_quant (steps of up to {GEMV_MAX_ROWS} rows; larger ones op by op)"
