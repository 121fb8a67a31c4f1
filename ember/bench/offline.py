"""`ember bench offline`: engine throughput in-process on a random-length workload, optionally against
Hugging Face transformers on the same weights (one request at a time, and in padded static batches).

Prompts are token ids of exact lengths and every request generates exactly its output length
(ignore_eos / min_new_tokens), so all three runs do the same useful work."""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ember.bench.datasets import LengthRange, PromptGenerator
from ember.bench.report import write_json
from ember.engine.args import EngineArgs
from ember.engine.llm_engine import freeze_startup_objects
from ember.errors import EmberError
from ember.loader import LoadedModel, load_model

# transformers model_type for each architecture ember's loader accepts
_HF_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    output_len: int


def throughput(requests: list[OfflineRequest], duration: float) -> dict[str, float]:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "request_throughput": len(requests) / duration,
        "duration_s": duration,
    }


def build_workload(generator: PromptGenerator, num_prompts: int, input_len: LengthRange,
                   output_len: LengthRange) -> list[OfflineRequest]:
    rng = generator.rng
    return [OfflineRequest([rng.choice(generator.word_ids) for _ in range(input_len.draw(rng))],
                           output_len.draw(rng))
            for _ in range(num_prompts)]


def run_ember(llm: Any, requests: list[OfflineRequest]) -> dict[str, float]:
    from ember import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    llm.generate([requests[0].prompt_token_ids[:8]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=True)
    duration = time.perf_counter() - start
    for request, output in zip(requests, outputs, strict=True):
        generated = len(output.outputs[0].token_ids)
        if generated != request.output_len:
            raise EmberError(f"ember generated {generated} tokens where {request.output_len} were asked "
                             f"(ignore_eos); the benchmark would be unfair")
    return throughput(requests, duration)


def hf_model_from(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' implementation of the architecture, holding ember's loaded weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = loaded.config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    hf_config = AutoConfig.for_model(
        _HF_MODEL_TYPES[c.architecture], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_ids, pad_token_id=c.eos_token_ids[0],
        **({"attention_bias": c.attention_bias} if c.architecture == "LlamaForCausalLM" else {}),
    )
    model = AutoModelForCausalLM.from_config(hf_config, dtype=c.torch_dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and c.tie_word_embeddings)]
    if missing or unexpected:
        raise EmberError(f"the HF baseline cannot take ember's weights: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _hf_generate(model: torch.nn.Module, batch: list[OfflineRequest], pad_id: int) -> None:
    longest = max(len(r.prompt_token_ids) for r in batch)
    new_tokens = max(r.output_len for r in batch)
    # Left padding, as batched generation needs: every row's next token lands in the same column.
    input_ids = torch.tensor([[pad_id] * (longest - len(r.prompt_token_ids)) + r.prompt_token_ids
                              for r in batch])
    attention_mask = torch.tensor([[0] * (longest - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                                   for r in batch])
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    if output.shape[1] != longest + new_tokens:
        raise EmberError("transformers stopped early; the baseline would be unfair")


def run_hf(model: torch.nn.Module, requests: list[OfflineRequest], batch_size: int, pad_id: int,
           label: str) -> dict[str, float]:
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    with torch.inference_mode():
        _hf_generate(model, [OfflineRequest(requests[0].prompt_token_ids[:8], 2)], pad_id)  # warm-up
        start = time.perf_counter()
        for batch in tqdm(batches, desc=label, unit="batch", file=sys.stderr):
            _hf_generate(model, batch, pad_id)
        duration = time.perf_counter() - start
    return throughput(requests, duration)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{' Offline Throughput ':=^78}",
             f"{'run':<18}{'output tok/s':>14}{'total tok/s':>14}{'req/s':>10}{'duration s':>12}{'ratio':>10}"]
    for key in ("ember", "hf_sequential", "hf_static_batch"):
        if key not in result:
            continue
        run = result[key]
        ratio = "" if key == "ember" else f"{result[f'ratio_vs_{key}']:.2f}x"
        lines.append(f"{key:<18}{run['output_throughput']:>14.1f}{run['total_token_throughput']:>14.1f}"
                     f"{run['request_throughput']:>10.2f}{run['duration_s']:>12.1f}{ratio:>10}")
    lines.append("=" * 78)
    return "\n".join(lines)


def run_offline(args: argparse.Namespace) -> int:
    from ember import LLM

    engine_args = EngineArgs.from_cli_args(args)
    input_len = LengthRange.parse(args.input_len, "--input-len")
    output_len = LengthRange.parse(args.output_len, "--output-len")
    if args.num_prompts < 1:
        raise EmberError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    llm = LLM(**dataclasses.asdict(engine_args))
    freeze_startup_objects()
    if input_len.high + output_len.high > llm.engine.max_model_len:
        raise EmberError(f"--input-len + --output-len reach {input_len.high + output_len.high} tokens, over the "
                         f"model's max length {llm.engine.max_model_len}")
    generator = PromptGenerator(llm.get_tokenizer(), random.Random(args.seed))
    requests = build_workload(generator, args.num_prompts, input_len, output_len)
    model_config = llm.engine.model_config
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": str(model_config.torch_dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "max_num_seqs": engine_args.max_num_seqs,
        "num_threads": torch.get_num_threads(),
        "total_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "total_output_tokens": sum(r.output_len for r in requests),
        "ember": run_ember(llm, requests),
    }
    if args.baseline == "hf":
        del llm  # free the engine's KV cache before transformers allocates its own
        model = hf_model_from(load_model(engine_args.model, dtype=model_config.torch_dtype))
        pad_id = model_config.eos_token_ids[0] if model_config.eos_token_ids else 0
        result["hf_sequential"] = run_hf(model, requests, 1, pad_id, "hf sequential")
        result["hf_static_batch"] = run_hf(model, requests, engine_args.max_num_seqs, pad_id, "hf static batch")
        for key in ("hf_sequential", "hf_static_batch"):
            result[f"ratio_vs_{key}"] = result["ember"]["output_throughput"] / result[key]["output_throughput"]
    print(format_table(result))
    if args.json:
        write_json(Path(args.json), result)
    return 0
