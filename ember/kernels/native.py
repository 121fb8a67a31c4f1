"""ember's C kernels for one model shape (x86-64 CPUs; bfloat16 with AVX-512, float32 with AVX-512 or AVX2),
called on torch tensors.

- paged_attention.c: decode and prompt-chunk (causal, row by row) attention read in place from the paged KV
  cache on AVX-512 vectors, replacing the gather of every sequence's K/V into a padded batch followed by SDPA.
- paged_prefill_attention.c (with AMX): prompt-chunk attention on AMX tiles instead.
- fused_ops.c: residual add + RMSNorm, SiLU-and-mul, RoPE + KV-cache write, one pass each.
- amx_gemm.c, bf16_gemm.c: Linear layers (the "native GEMM"): with AMX tiles where the CPU has them, else with
  AVX512-BF16 vectors; both take any number of rows and read the same re-laid-out weights.
- decoder_stack.c (AMX or AVX512-BF16): every decoder layer of a step in one call, the kernels above back to back
  (the layer loop is decoder_stack_body.h, shared by every dtype and weight format); decoder_stack_quant.c the
  same with quantized Linear weights (quant_gemm.c's GEMV, quant_panel_gemm.c's panels past it) for every step
  (decoder_stack_quant_f32.c in float32: decode-sized steps).
- paged_attention_f32.c, fused_ops_f32.c, f32_gemm.c, decoder_stack_f32.c: decode and prompt-chunk attention,
  the fused ops, the GEMM and the decoder stack for float32, on AVX-512 or AVX2 + FMA vectors (f32_simd.h).
- With an int8 KV cache (kv_cache.h), the attention kernels, the cache writes and the stacks are built with
  KV_INT8: they read and write its rows (prompt chunks on the vectors' kernel, also where AMX runs the GEMM).

Layers take a NativeKernels through their `native` attribute (set by the model runner) and keep their
PyTorch path for every other device and dtype."""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ember.errors import EmberError
from ember.kernels.build import KernelBuildError, bind, load_kernel
from ember.kernels.cpu import cpu_isa_level, kernel_level, level_at_least

logger = logging.getLogger(__name__)

_pointer, _int64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
ANY_ROWS = sys.maxsize
# kernel name (the ISA level it needs) -> (library, the most rows it is used for, the multiple of K it needs).
# Tried in this order. amx_gemm.c takes every
# Linear: in the engine it beats oneDNN's GEMM on pre-packed weights from 1 row (decode steps) to 1024
# (prefill steps; docs/benchmarks.md). bf16_gemm.c too, on Zen 4: 1.2-1.8x oneDNN's at 1-8 rows, ~1.1x at 16-64,
# even at 256 (both near the vdpbf16ps peak there; docs/benchmarks.md).
NATIVE_GEMMS = {"amx": ("amx_gemm.c", ANY_ROWS, 32), "avx512_bf16": ("bf16_gemm.c", ANY_ROWS, 2)}
# float32's GEMM (f32_gemm.c, AVX-512 or AVX2 + FMA, named by its vector ISA) op by op, for up to this many rows:
# past 32 rows oneDNN's float32 GEMM is faster (docs/benchmarks.md). The decoder stack takes every row count.
F32_GEMM_MAX_ROWS = 32
# Steps of more rows (prompt chunks) are faster op by op, on oneDNN's GEMMs, than in the float32 decoder stack:
# 6-9% on AVX2, 2-3% on AVX-512 (docs/benchmarks.md).
F32_STACK_MAX_ROWS = 64


# gemm(x, x_stride, packed, bias, out, rows, n, k, num_threads), every native GEMM.
_GEMM_ARGTYPES = (_pointer, _int64, _pointer, _pointer, _pointer, _int, _int64, _int64, _int)
# paged_prefill_attention(q, q_row_stride, cache, block_tables, max_blocks, query_starts, context_lens, out,
# num_seqs, num_kv_heads, block_size, scale, num_threads), in both dtypes.
_PREFILL_ARGTYPES = (_pointer, _int64, _pointer, _pointer, _int64, _pointer, _pointer, _pointer, _int, _int, _int,
                     _float, _int)
# decoder_stack_body.h's function, in every dtype and weight format: the layer table, the tensors, the step's
# rows, the model's shape.
_DECODER_STACK_ARGTYPES = (_pointer, _int, *(_pointer,) * 12, _int, _int, _pointer, _int64, _pointer, _int, _pointer,
                           _int64, _pointer, _pointer, *(_int,) * 5, _float, _float, _int)


class NativeKernels:
    """The kernels for one model shape and `dtype` (bfloat16 or float32), built for ISA `level`
    (ember/kernels/cpu.py; at least "avx512" for bfloat16, "avx2" for float32).

    float32 has every kernel on AVX-512 or AVX2 vectors (`vector_isa`, also its `gemm_name`): decode and
    prompt-chunk attention, the fused ops, the GEMM and the decoder stack. bfloat16's native GEMM is `gemm`, a
    name of NATIVE_GEMMS, or "auto" for the first that `level` includes and the CPU supports; `gemm_name` is
    None (and `gemm_max_rows` 0) when none is. bfloat16 has decode and prompt-chunk attention on AVX-512
    vectors, with the AMX GEMM prompt-chunk attention on AMX tiles (`prefill_isa` "amx"), and with either native
    GEMM the decoder stack."""

    def __init__(self, head_dim: int, queries_per_kv: int, level: str, dtype: torch.dtype = torch.bfloat16,
                 gemm: str = "auto", kv_cache_dtype: str = "auto") -> None:
        self.level, self.dtype, self.queries_per_kv = level, dtype, queries_per_kv
        self.vector_isa = "avx512" if level_at_least(level, "avx512") else "avx2"
        # The cache's element type (kv_cache.h): the model's dtype, or int8 where the kernels are built for it.
        self.kv_cache_element = torch.int8 if kv_cache_dtype == "int8" else dtype
        kv_format = (("KV_INT8", 1),) if kv_cache_dtype == "int8" else ()
        shape = self._shape = (("HEAD_DIM", head_dim), ("QUERIES_PER_KV", queries_per_kv), *kv_format)
        float32 = dtype == torch.float32
        suffix = "_f32" if float32 else ""
        attention = load_kernel("paged_attention_f32.c" if float32 else "paged_attention.c", shape, level)
        fused = load_kernel(f"fused_ops{suffix}.c", kv_format, level)
        self._decode = bind(attention, f"paged_decode_attention{suffix}", _pointer, _int64, _pointer, _pointer,
                            _int64, _pointer, _pointer, _int, _int, _int, _float, _int)
        self._add_rms_norm = bind(fused, f"add_rms_norm{suffix}", _pointer, _pointer, _pointer, _pointer, _int64,
                                  _int64, _float, _int)
        # Prompt chunks' attention: the vectors' (bfloat16's is AVX-512 code), unless AMX tiles take it.
        self.prefill_isa = self.vector_isa
        prefill = "paged_prefill_attention_f32" if float32 else "paged_prefill_attention_avx512"
        self._prefill = bind(attention, prefill, *_PREFILL_ARGTYPES)
        self._silu_and_mul = bind(fused, f"silu_and_mul{suffix}", _pointer, _pointer, _int64, _int64, _int)
        self._argmax = bind(fused, "argmax_f32_rows" if float32 else "argmax_bf16_rows", _pointer, _pointer, _int64,
                            _int64, _int)
        self._rotary_and_cache = bind(fused, f"rotary_and_cache{suffix}", _pointer, _pointer, _pointer, _pointer,
                                      _pointer, _int64, _int, _int, _int, _int)
        self.gemm_name: str | None = None
        self.gemm_max_rows = 0  # the most rows Linear gives it (it takes any number)
        self.has_decoder_stack = False
        self.decoder_stack_max_rows = ANY_ROWS  # larger steps run op by op
        if float32:
            self.gemm_name, self.gemm_max_rows = self.vector_isa, F32_GEMM_MAX_ROWS
            self._gemm = bind(load_kernel("f32_gemm.c", (), level), "f32_gemm", *_GEMM_ARGTYPES)
            self.has_decoder_stack, self.decoder_stack_max_rows, self._stack_level = True, F32_STACK_MAX_ROWS, level
            self._decoder_stack = bind(load_kernel("decoder_stack_f32.c", shape, level), "decoder_stack_f32",
                                       *_DECODER_STACK_ARGTYPES)
        else:
            self._bind_bfloat16_only(fused, shape, level, gemm)

    def _bind_bfloat16_only(self, fused: ctypes.CDLL, shape: tuple[tuple[str, int], ...], level: str,
                            gemm: str) -> None:
        self._apply_token_bitmask = bind(
            fused, "apply_token_bitmask_bf16_rows", _pointer, _pointer, _pointer, _int64, _int64, _int64, _int
        )
        for name in [name for name in NATIVE_GEMMS if gemm in ("auto", name) and level_at_least(level, name)]:
            source, max_rows, self._gemm_k_multiple = NATIVE_GEMMS[name]
            library = load_kernel(source, (), level)
            if getattr(library, f"{source[:-2]}_supported")():
                self.gemm_name, self.gemm_max_rows = name, max_rows
                self._gemm = bind(library, source[:-2], *_GEMM_ARGTYPES)
                break
        # Prompt chunks' attention on AMX tiles, where the AMX GEMM runs (it obtained the AMX state) and the K/V
        # are bfloat16.
        if self.gemm_name == "amx" and self.kv_cache_element == torch.bfloat16:
            prefill = load_kernel("paged_prefill_attention.c", shape, level)
            if prefill.paged_prefill_attention_supported():
                self.prefill_isa = "amx"
                self._prefill = bind(prefill, "paged_prefill_attention", *_PREFILL_ARGTYPES)
        # The stack is built for its GEMM's level, which picks its GEMM and prompt-chunk attention (decoder_stack.c):
        # the op-by-op path's own kernels.
        self.has_decoder_stack = self.gemm_name in ("amx", "avx512_bf16")
        if self.has_decoder_stack:
            self._stack_level = self.gemm_name
            self._decoder_stack = bind(load_kernel("decoder_stack.c", shape, self._stack_level), "decoder_stack",
                                       *_DECODER_STACK_ARGTYPES)

    @property
    def decoder_stack_name(self) -> str:
        """The decoder stack's kernel path, named by its GEMM's ISA ("off" without one); decoder_stack_quant*.c
        runs wherever it does, on its fused ops and attention."""
        return f"native_{self.gemm_name}" if self.has_decoder_stack else "off"

    @functools.cached_property
    def _decoder_stack_quant(self) -> ctypes._CFuncPtr:
        """decoder_stack_quant.c's stack (quantized Linear weights; decoder_stack_quant_f32.c in float32), built on
        first use: only quantized models call it."""
        name = "decoder_stack_quant_f32" if self.dtype == torch.float32 else "decoder_stack_quant"
        return bind(load_kernel(f"{name}.c", self._shape, self._stack_level), name, *_DECODER_STACK_ARGTYPES)

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [B, heads, D] (any row stride; heads and D contiguous), kv_cache one layer's
        ([blocks, block_size, ...]: ember/layers/kv_cache.py), block_tables [B, max_blocks] int64, context_lens
        [B] int64 (keys per sequence, this step's included) -> [B, heads * D]."""
        num_seqs, num_heads, head_dim = q.shape
        self._check_cache(kv_cache)
        _check(q.stride(2) == 1 and q.stride(1) == head_dim, "decode attention")
        out = torch.empty(num_seqs, num_heads * head_dim, dtype=q.dtype, device=q.device)
        self._decode(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), block_tables.data_ptr(),
                     block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(), num_seqs,
                     num_heads // self.queries_per_kv, kv_cache.shape[1], scale, torch.get_num_threads())
        return out

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of prompt chunks: q [T, heads, D] (any row stride), sequence i's queries being
        rows [query_starts[i], query_starts[i + 1]) (int64 [B + 1], starting at 0),
        its last new tokens, already in kv_cache (one layer's [blocks, block_size, ...]);
        block_tables [B, max_blocks] and context_lens [B] (keys per sequence, new ones included), int64
        -> [T, heads * D]."""
        num_tokens, num_heads, head_dim = q.shape
        self._check_cache(kv_cache)
        _check(q.stride(2) == 1 and q.stride(1) == head_dim, "prefill attention")
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        self._prefill(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), block_tables.data_ptr(),
                      block_tables.shape[1], query_starts.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
                      context_lens.shape[0], num_heads // self.queries_per_kv, kv_cache.shape[1], scale,
                      torch.get_num_threads())
        return out

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        # A cache of another element type than the kernels were built for would be read as garbage.
        if kv_cache.dtype != self.kv_cache_element:
            raise ValueError(f"native kernels built for a {self.kv_cache_element} KV cache got {kv_cache.dtype}")
        _check(kv_cache.is_contiguous(), "attention")

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual), the sum written into `residual` in place;
        without a residual, x is the new residual."""
        residual = x if residual is None else residual
        _check(x.is_contiguous() and residual.is_contiguous(), "add_rms_norm")
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0],
                           x.shape[1], eps, torch.get_num_threads())
        return out, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        _check(gate_up.is_contiguous(), "silu_and_mul")
        out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
        return out

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row's first maximal index of a [N, V] tensor of the kernels' dtype (contiguous) -> int64 [N]; the
        same as rows.float().max(dim=-1).indices, at memory speed."""
        _check(rows.dtype == self.dtype and rows.is_contiguous(), "argmax")
        out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
        self._argmax(rows.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], torch.get_num_threads())
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """-inf in place wherever bitmask (int32 [N, ceil(V / 32)], bit t % 32 of word t / 32 per token t) has a
        0 bit, in `rows` of bfloat16 logits [N, V] (contiguous); the other rows are untouched."""
        _check(
            logits.dtype == torch.bfloat16
            and logits.is_contiguous()
            and bitmask.dtype == torch.int32
            and bitmask.is_contiguous(),
            "apply_token_bitmask",
        )
        indices = torch.tensor(rows, dtype=torch.int64)
        self._apply_token_bitmask(
            logits.data_ptr(),
            bitmask.data_ptr(),
            indices.data_ptr(),
            len(rows),
            logits.shape[1],
            bitmask.shape[1],
            torch.get_num_threads(),
        )

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        num_heads: int,
    ) -> None:
        """Rotate qkv's q and k heads in place (qkv [T, (heads + 2 kv_heads) * D]; cos/sin [T, D] rows) and
        write each row's k and v into its slot of one layer's cache (ember/layers/kv_cache.py)."""
        self._check_cache(kv_cache)
        _check(qkv.is_contiguous() and cos.is_contiguous() and sin_signed.is_contiguous(), "rotary_and_cache")
        head_dim = cos.shape[-1]
        num_kv_heads = (qkv.shape[1] // head_dim - num_heads) // 2
        self._rotary_and_cache(qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), slot_mapping.data_ptr(),
                               kv_cache.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim,
                               torch.get_num_threads())


    def pack_gemm_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """weight [N, K] re-laid out for the native GEMM (bfloat16: [N/16][K/2][16][2]; float32: column panels
        [N/32][K][32]); None for shapes it cannot take (or without a native GEMM)."""
        n, k = weight.shape
        if self.gemm_name is None or n % 32:
            return None
        if self.dtype == torch.float32:
            return weight.view(n // 32, 32, k).transpose(1, 2).contiguous()
        if k % self._gemm_k_multiple:
            return None
        return weight.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, K] (unit stride over K) @ W^T + bias -> [rows, N], any number of rows (Linear uses it up to
        gemm_max_rows, where it beats oneDNN's)."""
        rows, k = x.shape
        if rows <= 0:
            raise ValueError(f"native GEMM takes 1 row or more, got {rows}")
        _check(x.stride(1) == 1, "GEMM")
        n = packed.numel() // k
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        self._gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                   out.data_ptr(), rows, n, k, torch.get_num_threads())
        return out

    def decoder_stack(
        self,
        layers: torch.Tensor,
        final_norm: torch.Tensor,
        embeddings: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        slot_mapping: torch.Tensor,
        decodes: DecodeRows | None,
        chunks: ChunkRows | None,
        shape: DecoderStackShape,
        quantized: bool = False,
    ) -> torch.Tensor:
        """Every decoder layer for one step and the final norm: embeddings [rows, hidden] (overwritten: the
        residual stream) -> final-normed hidden [rows, hidden]. The first rows are `decodes` (one new token
        per sequence), the rest `chunks` (prompt chunks), as the attention kernels take them. layers:
        [num_layers, 9] int64 pointers, per layer (decoder_stack_body.h's layer_tensors): input norm, qkv
        weight, qkv bias or 0, o weight, o bias or 0, post-attention norm, gate_up weight, down weight, that
        layer's KV cache; the weights packed for the native GEMM, or with
        `quantized` quant_gemm.c's quant_linear descriptors (QuantGemm.descriptors, whose scratch must hold
        `rows` rows). Writes the step's K/V into the caches, like the op-by-op path."""
        rows, hidden = embeddings.shape
        _check(embeddings.is_contiguous() and cos.is_contiguous() and sin_signed.is_contiguous()
               and all(t.is_contiguous() for t in (decodes or ()) + (chunks or ())), "decoder stack")
        q_width = shape.num_heads * shape.head_dim
        qkv_width = q_width + 2 * shape.num_kv_heads * shape.head_dim
        out, h, normed = (torch.empty_like(embeddings) for _ in range(3))
        qkv, attn, gate_up, act = (
            embeddings.new_empty(rows, width)
            for width in (qkv_width, q_width, 2 * shape.intermediate_size, shape.intermediate_size)
        )
        decode_args = (0, 0, 0, 0) if decodes is None else (
            decodes.context_lens.shape[0], decodes.block_tables.data_ptr(), decodes.block_tables.shape[1],
            decodes.context_lens.data_ptr())
        chunk_args = (0, 0, 0, 0, 0) if chunks is None else (
            chunks.context_lens.shape[0], chunks.block_tables.data_ptr(), chunks.block_tables.shape[1],
            chunks.query_starts.data_ptr(), chunks.context_lens.data_ptr())
        stack = self._decoder_stack_quant if quantized else self._decoder_stack
        stack(layers.data_ptr(), layers.shape[0], final_norm.data_ptr(), embeddings.data_ptr(), out.data_ptr(),
              h.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
              cos.data_ptr(), sin_signed.data_ptr(), slot_mapping.data_ptr(), rows, *decode_args, *chunk_args,
              hidden, shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.block_size, shape.eps,
              shape.head_dim**-0.5, torch.get_num_threads())
        return out


class DecodeRows(NamedTuple):
    """Single-token sequences as paged_decode_attention takes them (int64): [B, max_blocks], [B]."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor


class ChunkRows(NamedTuple):
    """Prompt chunks as paged_prefill_attention takes them (int64): [B, max_blocks], [B + 1], [B]."""

    block_tables: torch.Tensor
    query_starts: torch.Tensor
    context_lens: torch.Tensor


@dataclass(frozen=True)
class DecoderStackShape:
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    eps: float


KERNEL_PARTS = ("gemm", "attention_decode", "attention_prefill", "fused_ops", "decoder_stack")


def kernel_paths(native: NativeKernels | None) -> dict[str, str]:
    """Which code runs each part of a step, by KERNEL_PARTS: "native_<ISA the kernel is written for>" or
    "torch" ("off" for the decoder stack, whose parts then run one by one)."""
    if native is None:
        return {**dict.fromkeys(KERNEL_PARTS, "torch"), "decoder_stack": "off"}
    vector = f"native_{native.vector_isa}"
    gemm = "torch"
    if native.gemm_name is not None:
        gemm = f"native_{native.gemm_name}"
        if native.gemm_max_rows < ANY_ROWS:
            in_stack = "every row count in the decoder stack; op by op " if native.has_decoder_stack else ""
            gemm += f" ({in_stack}up to {native.gemm_max_rows} rows, else torch)"
    stack = native.decoder_stack_name
    if native.has_decoder_stack and native.decoder_stack_max_rows < ANY_ROWS:
        stack += f" (steps of up to {native.decoder_stack_max_rows} rows, else op by op)"
    return {
        "gemm": gemm,
        "attention_decode": vector,
        "attention_prefill": f"native_{native.prefill_isa}",
        "fused_ops": vector,
        "decoder_stack": stack,
    }


def _check(condition: bool, kernel: str) -> None:
    if not condition:
        raise ValueError(f"native {kernel} needs contiguous inputs")


def load_native_kernels(
    setting: str,
    device: torch.device,
    dtype: torch.dtype,
    widths: tuple[int, ...],
    head_dim: int,
    queries_per_kv: int,
    kv_cache_dtype: str = "auto",
) -> NativeKernels | None:
    """The kernels for `setting` "native" or an ISA level (an error if they cannot run here) or "auto" (None,
    logged, if they cannot); None for "torch". `widths`: the hidden and intermediate sizes the fused ops will
    see; `kv_cache_dtype`: the KV cache's (ember/layers/kv_cache.py)."""
    if setting == "torch":
        return None
    try:
        level = kernel_level(setting, cpu_isa_level())
    except ValueError as exc:
        raise EmberError(str(exc)) from None
    reason = _unsupported_reason(device, dtype, widths, head_dim, level)
    if reason is None:
        try:
            return NativeKernels(head_dim, queries_per_kv, level, dtype, kv_cache_dtype=kv_cache_dtype)
        except KernelBuildError as exc:
            reason = str(exc)
    if setting != "auto":
        raise EmberError(f"native kernels cannot run here: {reason}")
    logger.info("kernels: torch (native kernels unavailable: %s)", reason)
    return None


def _unsupported_reason(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...], head_dim: int,
                        level: str) -> str | None:
    if device.type != "cpu":
        return f"they are CPU kernels and the device is {device}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"they are bfloat16 and float32 kernels and the dtype is {dtype}"
    if head_dim % 32 or any(width % 16 for width in widths):
        return f"head_dim {head_dim} is not a multiple of 32 or a layer width of {widths} not one of 16"
    if dtype == torch.bfloat16 and not level_at_least(level, "avx512"):
        return f"the bfloat16 kernels need AVX-512 and the ISA level is {level}"
    if not level_at_least(level, "avx2"):
        return f"the float32 kernels need AVX2 and FMA and the ISA level is {level}"
    return None
