"""Runs one engine step: builds the step's inputs and attention metadata once, one batched forward over every
scheduled token (K/V written into and read from the paged cache), logits for the rows that sample, the sampler.

Under tensor parallelism every rank has a ModelRunner over its shard: rank 0 builds each step's StepInputs and
broadcasts them, every rank runs forward_step on them, and rank 0 alone samples; workers sit in
run_worker_loop."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ember.engine.args import EngineArgs
from ember.engine.load_memory import measure_load
from ember.engine.parallel import TensorParallelGroup
from ember.engine.resources import GiB, MiB, num_kv_blocks, resolve_device
from ember.engine.sampler import SampledToken, Sampler
from ember.engine.sampling_metadata import SamplingMetadata
from ember.engine.scheduler import ScheduledSeq, SchedulerOutput
from ember.engine.structured_output.grammar import GrammarMatcher, allocate_bitmask, fill_bitmasks
from ember.kernels.native import kernel_paths, load_native_kernels
from ember.layers.attention import SequenceSpan, build_attention_metadata
from ember.layers.kv_cache import allocate_kv_cache
from ember.layers.linear import (
    attach_quant_gemm,
    attach_quant_gemm_beside_floats,
    pack_gemm_weights,
    pack_linear_weights,
    quantize_linears_int8,
    quantized_gemm_path,
    quantized_stack_path,
)
from ember.models import build_model
from ember.models.config import ModelConfig, dtype_reason, onednn_supports_bfloat16

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """What every rank needs to run one step's forward (rank 0 broadcasts it under tensor parallelism)."""

    input_ids: list[int]
    positions: np.ndarray
    spans: list[SequenceSpan]  # in flat-batch order: context length, new tokens and block table of each
    logit_rows: list[int]  # the rows whose logits the step needs, in order
    all_rows_in_order: bool  # logit_rows is every row of the batch, in order: no selection needed


class ModelRunner:
    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], args: EngineArgs,
                 tp: TensorParallelGroup | None = None) -> None:
        self.device = resolve_device(args.device) if tp is None else tp.device
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)) or 1)
        self.config = config
        self.dtype = config.torch_dtype
        self.block_size = args.block_size
        self.tp = tp
        self.model = build_model(config, self.device, tp)
        self.load_memory = measure_load(self.model, lambda: self.model.load_weights(state_dict))
        if args.quantization == "int8":
            logger.info("quantization int8: %d Linear weights quantized per output channel",
                        quantize_linears_int8(self.model))
        if args.quantization == "auto":
            self.quant_gemm = attach_quant_gemm_beside_floats(self.model, args.kernels, self.dtype)
        else:
            self.quant_gemm = attach_quant_gemm(self.model, args.kernels)
        layout = self.model.layout
        peak = self.load_memory.peak_growth_bytes
        logger.info("rank %d of %d loaded %.1f MiB of weights; resident memory peaked %s MiB above its level "
                    "before loading", layout.rank, layout.size, self.load_memory.weight_bytes / MiB,
                    "?" if peak is None else f"{peak / MiB:.1f}")
        self.native = load_native_kernels(
            args.kernels, self.device, self.dtype, (config.hidden_size, layout.intermediate_size), config.head_dim,
            layout.num_heads // layout.num_kv_heads, args.kv_cache_dtype,
        )
        for module in self.model.modules():
            if hasattr(module, "native"):
                module.native = self.native
        if self.native is not None and self.native.gemm_name is not None:
            pack_gemm_weights(self.model, self.native)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and onednn_supports_bfloat16():
            pack_linear_weights(self.model)

        self.num_blocks = num_kv_blocks(config, self.block_size, self.dtype, self.device, args.kv_cache_memory,
                                        args.max_num_seqs, args.max_model_len, args.kv_cache_dtype)
        # One tensor for every layer's K and V (ember/layers/kv_cache.py). Under TP each rank holds its own KV
        # heads' part of every block (the block count is the same on every rank).
        self.kv_cache_dtype = "int8" if args.kv_cache_dtype == "int8" else str(self.dtype).removeprefix("torch.")
        # vLLM's cache_config_info labels (its --kv-cache-dtype "auto" reported as the dtype it stands for).
        self.cache_config = {"block_size": str(self.block_size), "cache_dtype": self.kv_cache_dtype,
                             "num_gpu_blocks": str(self.num_blocks),
                             "enable_prefix_caching": str(args.enable_prefix_caching)}
        self.kv_cache = allocate_kv_cache(config.num_hidden_layers, self.num_blocks, self.block_size,
                                          layout.num_kv_heads, config.head_dim, self.dtype, args.kv_cache_dtype,
                                          self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(self.device, args.seed, self.native)
        # One thread: the step's grammar masks are filled in order, overlapping the step's forward.
        self.mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-grammar-mask")
        self.dtype_reason = dtype_reason(args.dtype, self.device)
        self.kernel_level = self.native.level if self.native is not None else "none"
        self.kernel_paths = kernel_paths(self.native)
        if self.quant_gemm is not None:
            self.kernel_paths["gemm"] = quantized_gemm_path(self.model, self.quant_gemm, self.dtype,
                                                            self.kernel_paths["gemm"])
            self.kernel_paths["decoder_stack"] = quantized_stack_path(
                self.model, "off" if self.native is None else self.native.decoder_stack_name, self.dtype,
                self.kernel_paths["decoder_stack"])
        logger.info("model runner%s: %s on %s (%s), %d KV blocks of %d tokens in %s (%.2f GiB), kernels: %s",
                    "" if tp is None else f" (tensor-parallel rank {tp.rank} of {tp.size})",
                    self.dtype, self.device, self.dtype_reason, self.num_blocks, self.block_size, self.kv_cache_dtype,
                    self.kv_cache.numel() * self.kv_cache.element_size() / GiB,
                    f"native, ISA level {self.kernel_level}" if self.native else "torch")
        for part, path in self.kernel_paths.items():
            logger.info("kernel path: %s = %s", part, path)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One batched forward over every scheduled token, then sampling for the chunks that end their
        sequence, and the scores of prompt tokens for sequences that ask for prompt logprobs."""
        scheduled = out.scheduled
        # Decode rows (one token past the prompt) first, by context length, so each attention group pads its sequences'
        # K/V to similar lengths; prefill chunks after them in the scheduler's order.
        order = sorted(range(len(scheduled)), key=lambda i: _row_order(scheduled[i]))
        input_ids: list[int] = []
        positions = []
        spans = []
        sample_rows = []
        sampled_seqs = []
        grammar_rows: list[tuple[int, GrammarMatcher]] = []  # (row among sample_rows, matcher) without drafts
        drafted_grammars: list[tuple[int, GrammarMatcher, list[int]]] = []  # (first row, matcher, drafts)
        masked_rows: list[int] = []  # every sample row of a sequence with a grammar
        prompt_rows: list[int] = []  # rows whose logits score the next prompt token (prompt_logprobs)
        prompt_targets: list[int] = []
        prompt_counts: list[tuple[int, int]] = []  # (scheduled index, rows) per chunk that scores its prompt
        for i in order:
            item = scheduled[i]
            seq = item.seq
            start, count = seq.num_computed_tokens, item.num_new_tokens
            draft = item.draft_token_ids
            first_row = len(input_ids)
            input_ids += seq.token_ids[start : start + count - len(draft)]
            input_ids += draft
            positions.append(np.arange(start, start + count))
            spans.append(SequenceSpan(start, count, seq.block_table, start < seq.num_prompt_tokens))
            if item.sample:
                if seq.grammar is not None:
                    if draft:
                        drafted_grammars.append((len(sample_rows), seq.grammar, draft))
                    else:
                        grammar_rows.append((len(sample_rows), seq.grammar))
                    masked_rows.extend(range(len(sample_rows), len(sample_rows) + 1 + len(draft)))
                # A decode with drafts needs the logits after its token and after each draft token.
                sample_rows.extend(range(len(input_ids) - 1 - len(draft), len(input_ids)))
                sampled_seqs.append(i)
            if seq.params.prompt_logprobs is not None and start + 1 < seq.num_prompt_tokens:
                # Position p's logits score prompt token p + 1, up to the prompt's last token.
                scored = min(start + count, seq.num_prompt_tokens - 1) - start
                prompt_rows.extend(range(first_row, first_row + scored))
                prompt_targets += seq.token_ids[start + 1 : start + 1 + scored]
                prompt_counts.append((i, scored))
        # The matchers fill the grammar rows' bitmask on the mask thread while the forward runs. The bitmask
        # is allocated here: a torch op on the mask thread would give it an OpenMP thread pool of its own, and
        # with more OpenMP threads than cores libgomp stops spinning at barriers, so every later forward
        # (constrained or not) waits on futex wake-ups: ~30% slower steps (docs/benchmarks.md).
        bitmask = None
        if masked_rows:
            empty = allocate_bitmask(len(sample_rows), self.config.vocab_size)
            bitmask = self.mask_thread.submit(_fill_grammar_masks, empty, grammar_rows, drafted_grammars)
        rows = sample_rows + prompt_rows
        step = StepInputs(input_ids, np.concatenate(positions), spans, rows,
                          len(rows) == len(input_ids) and not prompt_rows)  # all-decode steps: every row, in order
        if self.tp is not None:
            self.tp.broadcast_object(step)
        logits = self.forward_step(step)
        result = ModelRunnerOutput([None] * len(scheduled), [None] * len(scheduled))
        if logits is None:
            return result
        if sample_rows:
            metadata = SamplingMetadata.from_sequences(
                [scheduled[i].seq for i in sampled_seqs], [scheduled[i].draft_token_ids for i in sampled_seqs],
                self.config.eos_token_ids, self.device,
                (masked_rows, bitmask.result().to(self.device)) if bitmask is not None else None)
            tokens = self.sampler(logits[: len(sample_rows)], metadata)
            for i, token in zip(sampled_seqs, tokens, strict=True):
                result.sampled[i] = token
        if prompt_rows:
            scores = iter(self.sampler.score(
                logits[len(sample_rows):], prompt_targets,
                [scheduled[i].seq.params.prompt_logprobs for i, count in prompt_counts for _ in range(count)],
            ))
            for i, count in prompt_counts:
                result.prompt_logprobs[i] = [next(scores) for _ in range(count)]
        return result

    @torch.inference_mode()
    def forward_step(self, step: StepInputs) -> torch.Tensor | None:
        """The forward over the step's tokens; the logits of its logit_rows in the model dtype (the sampler
        upcasts itself where it needs more than each row's argmax), None when it needs none."""
        meta = build_attention_metadata(step.spans, self.block_size, self.dtype, self.device, self.native)
        hidden = self.model(
            torch.tensor(step.input_ids, device=self.device),
            torch.from_numpy(step.positions).to(self.device),
            meta,
            self.kv_caches,
        )
        if not step.logit_rows:
            return None
        if not step.all_rows_in_order:
            hidden = hidden[torch.tensor(step.logit_rows, device=self.device)]
        return self.model.compute_logits(hidden, upcast=False)

    def run_worker_loop(self) -> None:
        """A worker rank: run every step rank 0 broadcasts, until it broadcasts None (shutdown)."""
        while (step := self.tp.broadcast_object()) is not None:
            self.forward_step(step)

    def shutdown(self) -> None:
        """Rank 0: tell the workers to leave run_worker_loop."""
        if self.tp is not None:
            self.tp.broadcast_object(None)


def _fill_grammar_masks(
    bitmask: torch.Tensor,
    rows: list[tuple[int, GrammarMatcher]],
    drafted: list[tuple[int, GrammarMatcher, list[int]]],
) -> torch.Tensor:
    """The step's allowed-token bitmask: one row per grammar sequence without drafts, and for one with drafts
    a row per position, each under the grammar advanced through the drafts before it (so a draft token the
    grammar refuses is rejected at its row, and the token drawn there follows the grammar)."""
    fill_bitmasks(bitmask, rows)
    for row, matcher, draft in drafted:
        matcher.fill_bitmask_through(bitmask, row, draft)
    return bitmask


@dataclass
class ModelRunnerOutput:
    """What one step computed, aligned with SchedulerOutput.scheduled."""

    # The tokens each sequence gains (its accepted draft tokens, then one sampled token); None where the
    # chunk does not reach the end of the sequence.
    sampled: list[list[SampledToken] | None]
    # Prompt logprobs: for a chunk of a sequence that asks for them, one entry per prompt token it scores
    # (the tokens after each of its positions, up to the prompt's last); None elsewhere.
    prompt_logprobs: list[list[SampledToken] | None]


def _row_order(item: ScheduledSeq) -> tuple[int, int]:
    if item.num_new_tokens == 1 and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens:
        return 0, item.seq.num_computed_tokens
    return 1, 0
