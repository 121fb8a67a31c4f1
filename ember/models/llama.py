"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2) in plain PyTorch.

q/k/v and gate/up projections are fused into one matmul each at load time; every token of an engine step goes
through one forward over a flat [T] batch, attention reading K/V through the paged cache.

Under tensor parallelism (ember/engine/parallel.py) each rank builds the same modules at its shard's sizes:
its query/KV heads, its part of the intermediate features and of the vocabulary; the attention and MLP
outputs are all-reduced, the embedding too (rows outside a rank's vocabulary are zero), and the logits
all-gathered."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from ember.engine.parallel import ShardLayout, TensorParallelGroup
from ember.errors import ModelLoadError
from ember.kernels.native import ANY_ROWS, ChunkRows, DecodeRows, DecoderStackShape, NativeKernels
from ember.kernels.quant_gemm import LinearDescriptors, tensor_address
from ember.kernels.quantized_weight import QuantizedWeight, cat_rows
from ember.layers.activation import SiluAndMul
from ember.layers.attention import AttentionMetadata, PagedAttention
from ember.layers.linear import Linear
from ember.layers.rmsnorm import RMSNorm
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from ember.loader.lazy_weights import LazyStateDict
from ember.models.config import ModelConfig


class LlamaAttention(nn.Module):
    native: NativeKernels | None = None  # fused RoPE + KV-cache write for bfloat16 on CPU (model runner sets it)

    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qk_size = q_size + kv_size
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        # Llama's attention_bias also biases o_proj; Qwen2 biases only q/k/v.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)  # row-parallel: its bias on rank 0 only
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.native is not None:
            self.native.rotary_and_cache(qkv, cos, sin, meta.slot_mapping, kv_cache, self.num_heads)
            q, k, v = qkv.view(num_tokens, -1, self.head_dim).split(
                (self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1
            )
            return self._output(self.attn(q, k, v, kv_cache, meta, kv_written=True))
        # q and k rotate together: one set of elementwise ops for both.
        qk = apply_rotary(qkv[:, : self.qk_size].view(num_tokens, -1, self.head_dim), cos, sin)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads :], v, kv_cache, meta)
        return self._output(out)

    def _output(self, attn_out: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(attn_out)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(config.hidden_size, 2 * layout.intermediate_size, bias=False)
        self.down_proj = Linear(layout.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(hidden)))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layout, tp)
        self.mlp = LlamaMLP(config, layout, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class _StackTable(NamedTuple):
    """The model's shape and the decoder stack's per-layer pointer tables ([num_layers, 9] each), in the order a
    decode step picks them (steps with prompt rows take the last): (most rows, table, quantized) with `quantized`
    tables holding quantized weights' descriptors (decoder_stack_quant.c) and the others float weights packed
    for the native GEMM (decoder_stack.c). `descriptors` keeps the quantized tables' descriptors alive."""

    shape: DecoderStackShape
    choices: tuple[tuple[int, torch.Tensor, bool], ...]
    descriptors: tuple[LinearDescriptors, ...]

    def pick(self, rows: int, prompt_rows: bool) -> tuple[torch.Tensor, bool] | None:
        """(table, quantized) for a step of `rows` rows, `prompt_rows` if one computes a prompt token; None: op
        by op."""
        for most_rows, table, quantized in self.choices[-1:] if prompt_rows else self.choices:
            if rows <= most_rows:
                return table, quantized
        return None


class LlamaForCausalLM(nn.Module):
    # Steps run every layer in one native call where the kernels have a decoder stack (bfloat16 with AMX or
    # AVX512-BF16, float32 on AVX-512 or AVX2: decoder_stack*.c; quantized weights: decoder_stack_quant*.c); the
    # model runner sets it.
    native: NativeKernels | None = None

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu",
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.layout = ShardLayout.for_rank(config, 0, 1) if tp is None else tp.layout
        vocab = self.layout.vocab_per_rank
        # An explicit (meta) weight skips Embedding's normal_ init, whose meta kernel imports torch._dynamo
        # (seconds of start-up time).
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size, _weight=torch.empty(vocab, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.layout, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, vocab, bias=False)
        # Built eagerly on the real device even when the module skeleton is built on "meta".
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling, config.torch_dtype, device)
        self.device = torch.device(device)
        # (KV cache address, the decoder stack's table, or None where it cannot run)
        self._stack_layers: tuple[int, _StackTable | None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden states [T, hidden]."""
        cos, sin = self.rotary(positions)
        hidden = self._embed(input_ids)
        # The decoder stack runs every layer in one call, with no point to all-reduce at: op by op under TP.
        if self.native is not None and self.native.has_decoder_stack and self.tp is None:
            stacked = self._run_decoder_stack(hidden, cos, sin, attn_metadata, kv_caches)
            if stacked is not None:
                return stacked
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, attn_metadata, kv_cache)
        return self.norm(hidden, residual)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        # Vocabulary-parallel: this rank's rows, zero for tokens another rank holds, summed over the ranks.
        local_ids = input_ids - self.layout.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.layout.vocab_per_rank)
        hidden = self.embed_tokens(local_ids.masked_fill(elsewhere, 0))
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(1), 0))

    def _run_decoder_stack(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """The step in one native call when every attention group runs a native kernel (one decode group
        and/or one group of prompt chunks, decodes first); None to run it op by op."""
        decodes = chunks = None
        for group in attn_metadata.groups:
            if group.context_lens is None:
                return None
            block_tables = group.block_ids.view(group.num_seqs, -1)
            if group.query_starts is None and decodes is None and chunks is None:
                decodes = DecodeRows(block_tables, group.context_lens)
            elif group.query_starts is not None and chunks is None:
                chunks = ChunkRows(block_tables, group.query_starts, group.context_lens)
            else:
                return None
        stack = self._decoder_stack_layers(kv_caches)
        picked = None if stack is None else stack.pick(hidden.shape[0], attn_metadata.prompt_rows)
        if picked is None:
            return None
        layers, quantized = picked
        return self.native.decoder_stack(layers, self.norm.weight, hidden, cos, sin, attn_metadata.slot_mapping,
                                         decodes, chunks, stack.shape, quantized)

    def _decoder_stack_layers(self, kv_caches: list[torch.Tensor]) -> _StackTable | None:
        """The decoder stack's tables of per-layer pointers and the model's shape (built once per KV cache); None
        when the projections have neither packed weights for the native GEMM (a shape it cannot take) nor, in
        a model whose projections are all quantized, quantized ones."""
        if self._stack_layers is None or self._stack_layers[0] != kv_caches[0].data_ptr():
            projections = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj) for layer in self.layers]
            linears = [p for layer in projections for p in layer]
            # Decode-sized steps on the quantized blocks (their GEMV's rows), then larger ones on int8 copies
            # (--quantization auto where batches run W8A8; with AMX up to QuantGemm.w8a8_max_rows), on the float
            # weights, or on the blocks' panels. Where several tables are kept, steps with prompt rows take the
            # last, which takes any number of rows and computes each row alike whatever the step's size (no
            # GEMV), so the tail of a prompt served from the prefix cache gets the values its first run computed,
            # and a repeated greedy request its answer; decode steps take the first whose rows they fit.
            candidates: list[tuple[int, LinearDescriptors | list[int]]] = []  # (most rows, weights)
            blocks = batch = panels = None
            beside_int8 = all(p.batch_quantized is not None for p in linears)
            if all(p.quantized is not None and p.quant_gemm is not None for p in linears):
                blocks = linears[0].quant_gemm.descriptors([p.quantized for p in linears], self.native.dtype,
                                                           beside_int8=beside_int8)
                candidates.append((blocks.gemv_rows, blocks))
            if beside_int8:
                batch = linears[0].quant_gemm.descriptors([p.batch_quantized for p in linears], self.native.dtype)
                candidates.append((batch.max_rows, batch))
            if all(p.gemm_weight is not None for p in linears):  # (in float32 on AVX2, small steps only)
                candidates.append((self.native.decoder_stack_max_rows, [p.gemm_weight.data_ptr() for p in linears]))
            if blocks is not None and len(candidates) == 1:  # the blocks alone: the GEMV, then their panels
                candidates = [(blocks.max_rows, blocks)]
            elif blocks is not None and candidates[-1][0] < ANY_ROWS and blocks.max_rows == ANY_ROWS:
                panels = linears[0].quant_gemm.descriptors([p.quantized for p in linears], self.native.dtype,
                                                           gemv=False)
                candidates.append((panels.max_rows, panels))
            stack = None
            if candidates:
                config = self.config
                shape = DecoderStackShape(config.intermediate_size, config.num_attention_heads,
                                          config.num_key_value_heads, config.head_dim, kv_caches[0].shape[1],
                                          config.rms_norm_eps)
                tables = []
                for most_rows, weights in candidates:
                    quantized = isinstance(weights, LinearDescriptors)
                    addresses = [weights.address(i) for i in range(len(linears))] if quantized else weights
                    tables.append((most_rows, self._stack_table(addresses, kv_caches), quantized))
                stack = _StackTable(shape, tuple(tables), tuple(d for d in (blocks, batch, panels) if d is not None))
            self._stack_layers = (kv_caches[0].data_ptr(), stack)
        return self._stack_layers[1]

    def _stack_table(self, weights: list[int], kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """[num_layers, 9] int64: decoder_stack_body.h's layer_tensors, with `weights` the four projections'
        (qkv, o, gate_up, down) weight pointers of each layer in order."""
        rows = []
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            attn = layer.self_attn
            qkv, o, gate_up, down = weights[4 * index : 4 * index + 4]
            rows.append([layer.input_layernorm.weight.data_ptr(), qkv, tensor_address(attn.qkv_proj.bias), o,
                         tensor_address(attn.o_proj.bias), layer.post_attention_layernorm.weight.data_ptr(), gate_up,
                         down, kv_cache.data_ptr()])
        return torch.tensor(rows, dtype=torch.int64)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]: float32, or with upcast=False the model dtype they are
        computed in (the matmul runs in the model dtype, as in Hugging Face, so greedy choices match it)."""
        logits = self.lm_head(hidden)
        if self.tp is not None:  # every rank computes its vocabulary's logits; the padding is cut off
            logits = self.tp.all_gather_last_dim(logits)[:, : self.config.vocab_size]
        return logits.float() if upcast else logits

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Take Hugging Face-named tensors; fuse q/k/v and gate/up; tie lm_head to the embedding if configured.

        Parameters are (re)created on the model's device in config.torch_dtype, so the module may have been
        built on the "meta" device. Under tensor parallelism each reads its rank's slice only: from a
        LazyStateDict (what the loader returns), only those bytes of the checkpoint."""
        config, layout = self.config, self.layout
        dtype, device = config.torch_dtype, self.device
        head_dim = config.head_dim
        weights = LazyStateDict.from_tensors(state_dict)

        def take(name: str, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"checkpoint lacks tensor {name}")
            quantized = weights.quantized(name)
            if quantized is not None:  # taken whole: the engine refuses quantization under TP
                return quantized
            return weights.read(name, dim, start, length).to(device=device, dtype=dtype)

        def vocab_rows(name: str) -> torch.Tensor:
            rows = take(name, 0, layout.vocab_start, min(layout.vocab_per_rank, config.vocab_size - layout.vocab_start))
            padding = layout.vocab_per_rank - rows.shape[0]  # the last rank's, where size does not divide vocab
            return torch.cat([rows, rows.new_zeros(padding, rows.shape[1])]) if padding else rows

        def assign(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
            expected = getattr(module, attr).shape
            if tensor.shape != expected:
                raise ModelLoadError(f"tensor for {attr} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
            if isinstance(tensor, QuantizedWeight):
                module.set_quantized(tensor)
            else:
                setattr(module, attr, nn.Parameter(tensor.contiguous(), requires_grad=False))

        assign(self.embed_tokens, "weight", vocab_rows("model.embed_tokens.weight"))
        assign(self.norm, "weight", take("model.norm.weight"))
        # A quantized file's tied output layer comes as its own (quantized) lm_head.weight.
        if config.tie_word_embeddings and "lm_head.weight" not in weights:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            assign(self.lm_head, "weight", vocab_rows("lm_head.weight"))
        # Column-parallel q/k/v and gate/up take this rank's output rows, row-parallel o/down its input columns.
        q_rows = (layout.first_head * head_dim, layout.num_heads * head_dim)
        kv_rows = (layout.first_kv_head * head_dim, layout.num_kv_heads * head_dim)
        mlp_rows = (layout.rank * layout.intermediate_size, layout.intermediate_size)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [(prefix + f"self_attn.{p}_proj", rows) for p, rows in zip("qkv", (q_rows, kv_rows, kv_rows), strict=True)]
            assign(attn.qkv_proj, "weight", cat_rows([take(p + ".weight", 0, *rows) for p, rows in qkv], dtype))
            if attn.qkv_proj.bias is not None:
                assign(attn.qkv_proj, "bias", torch.cat([take(p + ".bias", 0, *rows) for p, rows in qkv]))
            assign(attn.o_proj, "weight", take(prefix + "self_attn.o_proj.weight", 1, *q_rows))
            if attn.o_proj.bias is not None:  # added once: by rank 0 before the all-reduce
                bias = take(prefix + "self_attn.o_proj.bias")
                assign(attn.o_proj, "bias", bias if layout.rank == 0 else torch.zeros_like(bias))
            gate_up = [take(prefix + f"mlp.{p}_proj.weight", 0, *mlp_rows) for p in ("gate", "up")]
            assign(mlp.gate_up_proj, "weight", cat_rows(gate_up, dtype))
            assign(mlp.down_proj, "weight", take(prefix + "mlp.down_proj.weight", 1, *mlp_rows))
            assign(layer.input_layernorm, "weight", take(prefix + "input_layernorm.weight"))
            assign(layer.post_attention_layernorm, "weight", take(prefix + "post_attention_layernorm.weight"))
        still_meta = [name for name, p in self.named_parameters() if p.is_meta]
        if still_meta:
            raise ModelLoadError(f"parameters left unloaded: {', '.join(still_meta[:5])}")
