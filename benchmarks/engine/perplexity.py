"""Perplexity of a model on a held-out text, scored by the engine itself through prompt_logprobs.

    PYTHONPATH=. .venv/bin/python benchmarks/engine/perplexity.py --quantization none|gguf|int8 \\
        [--model smollm2-135m-instruct] [--dtype float32] [--kv-cache-dtype auto|int8] [--step-tokens 16] \\
        [--text FILE]

The text (default: texts/declaration_and_gettysburg.txt, the Declaration of Independence and the Gettysburg
Address, public domain, ~2k SmolLM2 tokens) is one prompt; every token after the first is scored given the
ones before it, and perplexity = exp(mean negative log-likelihood). The prompt is fed in steps of
--step-tokens tokens (default 16, the most rows the quantized decode kernel takes), so that every matmul
runs the kernel decode steps run, not the dequantized prompt path. Prints one JSON line. Used for
docs/benchmarks.md, issue 14.

--chunk-tokens N scores the text as llama.cpp's `llama-perplexity -c N` does, so that the two engines' figures
compare: the tokens are cut into whole chunks of N, each chunk is a prompt of its own, and only the second half
of each chunk is scored (every scored token sees at least N/2 tokens of context)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from ember import LLM, SamplingParams
from ember.engine.args import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES
from ember.kernels import KERNEL_CHOICES

DEFAULT_TEXT = Path(__file__).parent / "texts" / "declaration_and_gettysburg.txt"


def score_text(llm: LLM, text: str, chunk_tokens: int | None = None) -> list[float]:
    """The log-likelihood of each scored token of `text` given the ones before it in its prompt: every token
    after the first of one prompt, or with `chunk_tokens`, the second half of each whole chunk of that many."""
    token_ids = llm.get_tokenizer().encode(text)
    if chunk_tokens is None:
        prompts, first_scored = [token_ids], 1
    else:
        count = len(token_ids) // chunk_tokens
        if count == 0:
            raise SystemExit(f"the text has {len(token_ids)} tokens, fewer than one chunk of {chunk_tokens}")
        prompts = [token_ids[i * chunk_tokens:(i + 1) * chunk_tokens] for i in range(count)]
        first_scored = chunk_tokens // 2
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [
        entry[token].logprob
        for prompt, output in zip(prompts, outputs, strict=True)
        for entry, token in zip(output.prompt_logprobs[first_scored:], prompt[first_scored:], strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model alias, folder or .gguf file")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATION_CHOICES,
        help="how the Linear weights are held, as ember serve --quantization",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="activation dtype (default: %(default)s, the reference precision)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=KERNEL_CHOICES,
        help="kernel ISA level, as ember serve --kernels (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="the KV cache's format, as ember serve --kv-cache-dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--step-tokens", type=int, default=16, help="prompt tokens per engine step (default: %(default)s)"
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="score as llama-perplexity -c N: whole chunks of N tokens, the second half of each (default: the "
        "whole text as one prompt)",
    )
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument(
        "--text", type=Path, default=DEFAULT_TEXT, help="the held-out text (default: %(default)s)"
    )
    args = parser.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kernels=args.kernels,
        kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.num_threads,
        max_num_batched_tokens=args.step_tokens,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    start = time.perf_counter()
    logprobs = score_text(llm, args.text.read_text(), args.chunk_tokens)
    mean_nll = -sum(logprobs) / len(logprobs)
    print(
        json.dumps(
            {
                "model": args.model,
                "quantization": args.quantization,
                "dtype": args.dtype,
                "kv_cache_dtype": args.kv_cache_dtype,
                "text": args.text.name,
                "chunk_tokens": args.chunk_tokens,
                "scored_tokens": len(logprobs),
                "mean_nll": round(mean_nll, 5),
                "perplexity": round(math.exp(mean_nll), 4),
                "gemm": llm.engine.runner.kernel_paths["gemm"],
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
