"""A Linear weight kept quantized, laid out as quant_gemm.c reads it.

Formats (QUANT_FORMATS):
- "q8_0", "q4_0", "q4_1": GGUF's block types, as the file stores them: per block of 32 weights along a row,
  an fp16 scale d (and for Q4_1 an fp16 min m); Q8_0 holds int8 values (w = d q), Q4_0 and Q4_1 4-bit
  values two per byte in llama.cpp's order (byte i of a block: weight i in the low nibble, weight 16 + i in
  the high one; w = d (q - 8), w = d q + m). The blocks' values and their scales are split into separate
  arrays so that the kernel loads aligned runs of each.
- "q4_k": GGUF's Q4_K (super-blocks of 256 weights: fp16 d and dmin, 6-bit scale and min per block of 32,
  w = d sc q - dmin m), its nibbles re-laid out at load in Q4_1's order per block of 32 so that one kernel
  unpacks both; `scales` holds each super-block's 8 block scales sc then its 8 block mins m (uint8, 16 per
  super-block) and `mins` its d and dmin (fp16, 2 per super-block): 4.625 bits per weight, the file's 4.5.
- "q6_k": GGUF's Q6_K (super-blocks of 256 weights: fp16 d, an int8 scale sc per 16 weights, 6-bit q,
  w = d sc (q - 32)) as int8 values v = q - 32 in order (as Q8_0's) and w = d sc v - dmin m with a min m per 32
  weights (0 for Q6_K's own rows): `scales` holds per super-block its 16 int8 sc then 8 uint8 m (24 bytes), `mins`
  its fp16 d and dmin (0 for Q6_K): 8.8 bits per weight, the file's 6.56. Q4_K rows fused with Q6_K ones in one
  projection (llama.cpp's Q4_K_M files keep attn_v in Q6_K beside Q4_K attn_q and attn_k) take this form too
  (v = q, each sc twice), so the projection stays one quantized weight.
- "q5_0", "q5_1": GGUF's Q5_0 and Q5_1 (per block of 32: fp16 d, and fp16 m for Q5_1, 5-bit q; w = d (q - 16),
  w = d q + m). A row holds the low 4 bits as Q4_0's nibbles (k / 2 bytes, the file's order), then their fifth
  bits, 8 bytes per pair of blocks (2j, 2j + 1): a 32-bit mask for the weights the pair's low nibbles hold (bit i:
  block 2j's weight i, bit 16 + i: block 2j + 1's weight i, i < 16), then one for its high nibbles' (weights
  16 + i), little-endian; a lone last block's pair has zeros for its second block. So the kernel unpacks one pair
  as Q4's and sets the fifth bits from two masks: the file's 5.5 bits per weight (6 for Q5_1, with its m).
  llama.cpp's own Q4_K_M and Q5_K_M of a model whose rows are not whole super-blocks of 256 (SmolLM2's) are
  mostly Q5_0 and Q5_1.
- "q5_k": GGUF's Q5_K (Q4_K's super-blocks with a fifth bit per weight, w = d sc q - dmin m) as "q4_k" with the
  fifth bits as "q5_0"'s masks after each row's nibbles: 5.625 bits per weight, the file's 5.5.
- "q8_0_min": int8 values with an fp16 scale d and min m per block (w = d q + m): the form a projection fusing
  Q5_1 rows (q = their 5-bit values) with Q8_0 ones (m = 0) takes, a Q5_K_M file's q, k and v where v is Q8_0.
- "int8": weight-only int8 with one float32 scale per output row (max |w| / 127), made from any float
  weight (`--quantization int8`).
- "int8_panels": int8's values and scales, the values stored as w + 128 (uint8) in the panel layout of
  w8a8_panel_gemm.c ([N / 32][2][K / 4][16][4]), which runs them with int8 activations at every batch size
  without re-laying them out per call. Made at load for --quantization auto's batches (N a multiple of 32, K of
  W8A8_GROUP); its rows are interleaved, so it takes no row operations.

Rows are independent (blocks run along a row), so the loader's row operations (q/k un-permutation, q/k/v and
gate/up concatenation) apply to every array of a weight alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

BLOCK = 32
SUPER_BLOCK = 256  # the K-quants' (Q4_K, Q6_K): 8 blocks of 32
QUANT_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q8_0_min", "int8", "int8_panels")
NIBBLE_FORMATS = ("q4_0", "q4_1", "q4_k")
FIVE_BIT_FORMATS = ("q5_0", "q5_1", "q5_k")  # Q4_0's nibbles, then the fifth bits
SUPER_BLOCK_FORMATS = ("q4_k", "q5_k", "q6_k")  # their rows are whole super-blocks
BLOCK_MIN_FORMATS = ("q4_1", "q5_1", "q8_0_min")  # an fp16 min per block of 32 in `mins`
PANEL_OUTPUTS, W8A8_GROUP = 32, 64  # w8a8_panel_gemm.c: outputs per panel, activations per int8 scale
# GGUF block type name -> (format, bytes per block: fp16 scale, fp16 min for Q4_1, then the values)
GGUF_BLOCK_FORMATS = {
    "Q8_0": ("q8_0", 2 + BLOCK),
    "Q4_0": ("q4_0", 2 + BLOCK // 2),
    "Q4_1": ("q4_1", 4 + BLOCK // 2),
    "Q5_0": ("q5_0", 2 + 4 + BLOCK // 2),  # fp16 d, 32 fifth bits, 16 bytes of low nibbles
    "Q5_1": ("q5_1", 4 + 4 + BLOCK // 2),  # fp16 d and m, then as Q5_0
    "Q4_K": ("q4_k", 4 + 12 + SUPER_BLOCK // 2),  # per super-block: d, dmin, 12 bytes of 6-bit sc/m, nibbles
    "Q5_K": ("q5_k", 4 + 12 + SUPER_BLOCK // 8 + SUPER_BLOCK // 2),  # as Q4_K, the fifth bits before the nibbles
    "Q6_K": ("q6_k", SUPER_BLOCK // 2 + SUPER_BLOCK // 4 + SUPER_BLOCK // 16 + 2),  # low 4 bits, high 2, sc, d
}


@dataclass(frozen=True)
class QuantizedWeight:
    format: str
    # int8 [N, K] (q8_0, q8_0_min, q6_k, int8), uint8 nibbles [N, K / 2] (q4_0, q4_1, q4_k), uint8
    # [N, K / 2 + 8 a block pair] (q5_0, q5_1, q5_k) or panels (int8_panels)
    values: torch.Tensor
    # float16 [N, K / 32], float32 [N] for int8 and int8_panels, uint8 [N, K / 256 * 16] for q4_k and q5_k and
    # [N, K / 256 * 24] for q6_k
    scales: torch.Tensor
    # float16: [N, K / 32] for q4_1, q5_1 and q8_0_min, [N, K / 256 * 2] (d, dmin) for q4_k, q5_k and q6_k
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        n, width = self.values.shape
        if self.format in FIVE_BIT_FORMATS:  # 16 bytes a block and 8 a pair: 20 a block, 4 more for a lone one
            return torch.Size((n, width // 20 * BLOCK))
        return torch.Size((n, width * 2 if self.format in NIBBLE_FORMATS else width))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._arrays())

    def _arrays(self) -> list[torch.Tensor]:
        return [t for t in (self.values, self.scales, self.mins) if t is not None]

    def map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The weight with `function` (a reordering or selection of rows) applied to each array."""
        return replace(
            self,
            **{
                f.name: function(getattr(self, f.name)).contiguous()
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as quant_gemm.c's dequantize_weight computes it (cat_rows' fallback)."""
        n, k = self.shape
        if self.format == "int8":
            return self.scales[:, None] * self.values.float()
        if self.format == "int8_panels":
            values = self.values.view(n // PANEL_OUTPUTS, 2, k // 4, 16, 4).permute(0, 1, 3, 2, 4).reshape(n, k)
            return self.scales[:, None] * (values.float() - 128)
        if self.format in ("q8_0", "q8_0_min"):
            scaled = self.scales.float()[:, :, None] * self.values.view(n, -1, BLOCK).float()
            return (scaled if self.mins is None else scaled + self.mins.float()[:, :, None]).view(n, k)
        if self.format == "q6_k":
            scales, mins = self.block_scales_and_mins()
            halves = scales.view(n, -1, 2, 1) * self.values.view(n, -1, 2, 16).float()
            return (halves.view(n, -1, BLOCK) + mins[:, :, None]).view(n, k)
        q = self.block_values().float()
        if self.format in ("q4_0", "q5_0"):
            return (self.scales.float()[:, :, None] * (q - (8 if self.format == "q4_0" else 16))).view(n, k)
        scales, mins = self.block_scales_and_mins()
        return (scales[:, :, None] * q + mins[:, :, None]).view(n, k)

    def block_values(self) -> torch.Tensor:
        """The nibble and five-bit formats' unsigned values q, int16 [N, K / 32, 32] in order along each block."""
        n, k = self.shape
        blocks = k // BLOCK
        packed = self.values[:, : blocks * BLOCK // 2].reshape(n, blocks, BLOCK // 2).to(torch.int16)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2)
        if self.format not in FIVE_BIT_FORMATS:
            return q
        masks = self.values[:, blocks * BLOCK // 2 :].reshape(n, -1, 2, 4).to(torch.int64)  # [pair, low/high, byte]
        bits = (masks[..., None] >> torch.arange(8)) & 1  # [pair, low/high, byte, bit]
        bits = bits.reshape(n, -1, 2, 2, 16).permute(0, 1, 3, 2, 4)  # [pair, block of the pair, low/high, i]
        return q | (bits.reshape(n, -1, BLOCK)[:, :blocks] << 4).to(torch.int16)

    def block_scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q4_1, q5_1, q8_0_min, q4_k, q5_k and q6_k: each block of 32's scale and min as float32 [N, K / 32]
        (w = scale q + min; q6_k's scales per 16 weights, [N, K / 16]); for q4_k, q5_k and q6_k d sc and
        -(dmin m), each product in float32 as llama.cpp's dequantizers compute it."""
        if self.format in BLOCK_MIN_FORMATS:
            return self.scales.float(), self.mins.float()
        n = self.values.shape[0]
        if self.format == "q6_k":
            per_super = self.scales.view(n, -1, 24)
            sc, m = per_super[:, :, :16].view(torch.int8).float(), per_super[:, :, 16:].float()
            d_dmin = self.mins.view(n, -1, 2).float()
            return (d_dmin[:, :, :1] * sc).view(n, -1), -(d_dmin[:, :, 1:] * m).view(n, -1)
        block_values = self.scales.view(n, -1, 2, SUPER_BLOCK // BLOCK).float()  # [n, super, (sc, m), 8]
        super_scales = self.mins.view(n, -1, 2, 1).float()  # [n, super, (d, dmin), 1]
        return ((super_scales[:, :, 0] * block_values[:, :, 0]).view(n, -1),
                -(super_scales[:, :, 1] * block_values[:, :, 1]).view(n, -1))

    @classmethod
    def from_gguf_blocks(cls, block_type: str, data: np.ndarray, rows: int) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes (uint8, `rows` rows) of a block type of GGUF_BLOCK_FORMATS."""
        format, block_bytes = GGUF_BLOCK_FORMATS[block_type]
        blocks = np.asarray(data, dtype=np.uint8).reshape(rows, -1, block_bytes)
        if format in ("q4_k", "q5_k"):
            return cls._from_k_quant_blocks(format, blocks)
        if format == "q6_k":
            return cls._from_q6_k_blocks(blocks)
        if format in FIVE_BIT_FORMATS:
            return cls._from_five_bit_blocks(format, blocks)
        scales = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0])
        mins = None
        if format == "q4_1":
            mins = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0])
        values = np.ascontiguousarray(
            blocks[:, :, block_bytes - (BLOCK if format == "q8_0" else BLOCK // 2) :]
        )
        values = torch.from_numpy(values.reshape(rows, -1))
        return cls(format, values.view(torch.int8) if format == "q8_0" else values, scales, mins)

    @classmethod
    def _from_k_quant_blocks(cls, format: str, blocks: np.ndarray) -> QuantizedWeight:
        """Q4_K or Q5_K super-blocks [rows, super, 144 or 176] (ggml's block_q4_K: d, dmin, 12 bytes of scales,
        qs[128]; block_q5_K: qh[32] before qs) as "q4_k" or "q5_k" (see the module docstring)."""
        rows, supers = blocks.shape[:2]
        d_dmin = np.ascontiguousarray(blocks[:, :, 0:4]).view(np.float16).reshape(rows, supers * 2)
        packed = blocks[:, :, 4:16].astype(np.uint8)
        # ggml's get_scale_min_k4: blocks 0-3 in the low 6 bits of bytes 0-3 (sc) and 4-7 (m); blocks 4-7 in the
        # nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-3 (sc) and 4-7 (m).
        sc = np.concatenate([packed[:, :, 0:4] & 63, (packed[:, :, 8:12] & 0x0F) | ((packed[:, :, 0:4] >> 6) << 4)], axis=2)
        m = np.concatenate([packed[:, :, 4:8] & 63, (packed[:, :, 8:12] >> 4) | ((packed[:, :, 4:8] >> 6) << 4)], axis=2)
        # Nibbles: per 64 weights, 32 bytes whose low nibbles are block 2j's weights 0-31 and high nibbles block
        # 2j + 1's; Q4_1's order puts weight i of a block in byte i % 16's low (i < 16) or high nibble.
        at = 16 if format == "q4_k" else 48
        qs = blocks[:, :, at:].reshape(rows, supers, 4, 32)
        weights = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, supers * 8, 2, 16)  # [block, half, i]
        values = (weights[:, :, 0] | (weights[:, :, 1] << 4)).astype(np.uint8).reshape(rows, -1)
        if format == "q5_k":  # qh[i]'s bit b: the fifth bit of the super-block's block b's weight i
            qh = blocks[:, :, 16:48].astype(np.uint64)  # [rows, super, i]
            fifth = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint64)[:, None]) & 1  # [rows, super, block, i]
            words = (fifth << np.arange(BLOCK, dtype=np.uint64)).sum(axis=3).reshape(rows, -1)
            values = np.concatenate([values, fifth_bit_masks(words)], axis=1)
        return cls(format, torch.from_numpy(np.ascontiguousarray(values)),
                   torch.from_numpy(np.ascontiguousarray(np.concatenate([sc, m], axis=2).reshape(rows, -1))),
                   torch.from_numpy(np.ascontiguousarray(d_dmin)))

    @classmethod
    def _from_q6_k_blocks(cls, blocks: np.ndarray) -> QuantizedWeight:
        """Q6_K super-blocks [rows, super, 210] (ggml's block_q6_K: ql[128], qh[64], int8 scales[16], fp16 d) as
        "q6_k" (see the module docstring)."""
        rows, supers = blocks.shape[:2]
        ql = blocks[:, :, 0:128].reshape(rows, supers, 2, 2, 32)  # [half][first or second 32 bytes][l]
        qh = blocks[:, :, 128:192].reshape(rows, supers, 2, 1, 32)
        # Per half of 128 weights, 4 runs of 32: low nibbles of ql's two runs, then their high nibbles, each with
        # 2 bits of qh (bits 0-1, 2-3, then 4-5, 6-7).
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [half][run 0-3][l]
        high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=3)
        values = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)
        scales = np.concatenate([blocks[:, :, 192:208], np.zeros((rows, supers, 8), np.uint8)], axis=2)  # sc, m = 0
        d_dmin = np.zeros((rows, supers, 2), np.float16)
        d_dmin[:, :, 0] = np.ascontiguousarray(blocks[:, :, 208:210]).view(np.float16)[:, :, 0]
        return cls("q6_k", torch.from_numpy(np.ascontiguousarray(values)),
                   torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1))),
                   torch.from_numpy(d_dmin.reshape(rows, -1)))

    @classmethod
    def _from_five_bit_blocks(cls, format: str, blocks: np.ndarray) -> QuantizedWeight:
        """Q5_0 or Q5_1 blocks [rows, blocks, 22 or 24] (ggml's block_q5_0: fp16 d, uint32 qh, qs[16]; block_q5_1:
        fp16 d and m, then the same; weight i's low 4 bits in byte i % 16 of qs, the low nibble for i < 16, its
        fifth bit bit i of qh) as "q5_0" or "q5_1" (see the module docstring)."""
        rows = blocks.shape[0]
        at = 2 if format == "q5_0" else 4  # qh's offset
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0]
        m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0] if format == "q5_1" else None
        qh = np.ascontiguousarray(blocks[:, :, at : at + 4]).view(np.uint32)[:, :, 0].astype(np.uint64)
        nibbles = blocks[:, :, at + 4 :].reshape(rows, -1)
        values = torch.from_numpy(np.ascontiguousarray(np.concatenate([nibbles, fifth_bit_masks(qh)], axis=1)))
        return cls(format, values, torch.from_numpy(d.copy()), None if m is None else torch.from_numpy(m.copy()))

    def as_q8_0(self) -> QuantizedWeight:
        """A q5_0 weight as q8_0, the same values (q - 16): for a projection fused with Q8_0 rows."""
        n, k = self.shape
        return QuantizedWeight("q8_0", (self.block_values() - 16).to(torch.int8).view(n, k), self.scales)

    def as_q8_0_min(self) -> QuantizedWeight:
        """A q5_1 or q8_0 weight as q8_0_min, the same values: for a projection fusing the two."""
        n, k = self.shape
        if self.format == "q8_0":
            return QuantizedWeight("q8_0_min", self.values, self.scales, torch.zeros_like(self.scales))
        return QuantizedWeight("q8_0_min", self.block_values().to(torch.int8).view(n, k), self.scales, self.mins)

    def as_q6_k(self) -> QuantizedWeight:
        """A q4_k weight in q6_k's form, the same values (see the module docstring)."""
        n, k = self.shape
        packed = self.values.view(n, -1, BLOCK // 2)
        values = torch.cat([packed & 0x0F, packed >> 4], dim=2).to(torch.int8).view(n, k)
        per_super = self.scales.view(n, -1, 2, SUPER_BLOCK // BLOCK)  # [n, super, (sc, m), 8]
        sc = per_super[:, :, 0].repeat_interleave(2, dim=2)  # each block's sc for both its halves
        return QuantizedWeight("q6_k", values.contiguous(), torch.cat([sc, per_super[:, :, 1]], dim=2).view(n, -1),
                               self.mins)

    @classmethod
    def int8_per_channel(cls, weight: torch.Tensor) -> QuantizedWeight:
        """Weight-only int8 of a float weight [N, K]: per output row, scale = max |w| / 127 and
        round(w / scale)."""
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1) / 127.0
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        values = torch.round(weight * inverse[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls("int8", values.contiguous(), scales.contiguous())


def fifth_bit_masks(words: np.ndarray) -> np.ndarray:
    """Per row, each block's 32 fifth bits (uint64 [rows, blocks], bit i: weight i's) as the five-bit formats'
    masks, uint8 [rows, 8 per block pair] (see the module docstring; a lone last block pairs with zeros)."""
    if words.shape[1] % 2:
        words = np.concatenate([words, np.zeros((words.shape[0], 1), words.dtype)], axis=1)
    first, second = words[:, 0::2], words[:, 1::2]
    low = (first & 0xFFFF) | ((second & 0xFFFF) << 16)  # the pair's low nibbles' weights (0-15 of each block)
    high = (first >> 16) | (second & 0xFFFF0000)  # its high nibbles' (16-31)
    return np.stack([low, high], axis=2).astype("<u4").view(np.uint8).reshape(words.shape[0], -1)


def int8_panels(weight: QuantizedWeight) -> QuantizedWeight:
    """An "int8" weight ([N, K], N a multiple of PANEL_OUTPUTS, K of W8A8_GROUP) as "int8_panels"."""
    n, k = weight.shape
    unsigned = (weight.values.to(torch.int16) + 128).to(torch.uint8)
    panels = unsigned.view(n // PANEL_OUTPUTS, 2, 16, k // 4, 4).permute(0, 1, 3, 2, 4).reshape(n, k)
    return QuantizedWeight("int8_panels", panels.contiguous(), weight.scales)


def cat_rows(
    weights: list[torch.Tensor | QuantizedWeight], dtype: torch.dtype
) -> torch.Tensor | QuantizedWeight:
    """Weights stacked along their rows (q/k/v into qkv): quantized ones of one format stay quantized; any
    other mix (a GGUF file may store v in another type than q and k) is dequantized to `dtype`."""
    formats = {w.format if isinstance(w, QuantizedWeight) else None for w in weights}
    if formats == {"q4_k", "q6_k"}:  # Q4_K_M's q, k and v: one q6_k weight
        weights = [w.as_q6_k() if w.format == "q4_k" else w for w in weights]
        formats = {"q6_k"}
    if formats == {"q5_0", "q8_0"}:  # a Q4_K_M file's q and k in Q5_0, v in Q8_0 (for Q6_K): one q8_0 weight
        weights = [w.as_q8_0() if w.format == "q5_0" else w for w in weights]
        formats = {"q8_0"}
    if formats == {"q5_1", "q8_0"}:  # a Q5_K_M file's: one q8_0_min weight
        weights = [w.as_q8_0_min() for w in weights]
        formats = {"q8_0_min"}
    if len(formats) == 1 and None not in formats:
        first = weights[0]
        arrays = [f.name for f in fields(first) if isinstance(getattr(first, f.name), torch.Tensor)]
        return replace(first, **{name: torch.cat([getattr(w, name) for w in weights]) for name in arrays})
    return torch.cat(
        [w.dequantize().to(dtype) if isinstance(w, QuantizedWeight) else w.to(dtype) for w in weights]
    )
