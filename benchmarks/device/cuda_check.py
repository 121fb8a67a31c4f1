"""The engine on a CUDA device, against itself on the CPU: one prepared check for a lent GPU.

Greedy token ids of a batch of varied prompts on cpu/float32 vs cuda/float32 and cuda/bfloat16 (agreement
per prompt), prefix-cache hits, seeded n=2 sampling reproducibility and ngram speculative decoding on
CUDA (its greedy tokens must equal plain greedy), and a throughput figure. Prints one JSON object.

    python benchmarks/device/cuda_check.py --model DIR [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ember.engine.llm import LLM
from ember.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Explain the theory of relativity in simple terms." * 3,
    "a b c d e f g h i j k l m n o p",
    "SELECT * FROM users WHERE",
    "The quick brown fox jumps over the lazy dog. " * 6,
]


def greedy_ids(llm: LLM, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Per prompt: how many leading tokens agree (float differences may flip a near-tie later)."""
    prefix = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"identical": sum(x == y for x, y in zip(a, b, strict=True)), "of": len(a), "common_prefix": prefix}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model folder or GGUF file")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args()
    result: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    result["gpu"] = torch.cuda.get_device_name(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the comparison

    cpu = LLM(args.model, dtype="float32", device="cpu")
    cpu_ids = greedy_ids(cpu, PROMPTS)
    del cpu

    gpu = LLM(args.model, dtype="float32", device="cuda")
    gpu_ids = greedy_ids(gpu, PROMPTS)
    result["float32_cpu_vs_cuda"] = agreement(cpu_ids, gpu_ids)
    again = greedy_ids(gpu, PROMPTS)  # the same prompts again: prefix-cache hits, same tokens
    result["cuda_repeat_identical"] = again == gpu_ids
    seeded = SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=7, max_tokens=24)
    runs = [[c.token_ids for out in gpu.generate(PROMPTS[:3], seeded) for c in out.outputs] for _ in range(2)]
    result["cuda_seeded_n2_reproducible"] = runs[0] == runs[1]
    batch = [p + f" #{i}" for i in range(64) for p in PROMPTS[:1]]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    gpu.generate(batch[:4], params)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = gpu.generate(batch, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result["cuda_float32_batch64_out_tok_per_s"] = round(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, 1)
    del gpu

    spec = LLM(args.model, dtype="float32", device="cuda",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    result["cuda_ngram_spec_equals_greedy"] = greedy_ids(spec, PROMPTS) == gpu_ids
    del spec

    bf16 = LLM(args.model, dtype="bfloat16", device="cuda")
    result["bfloat16_cuda_vs_float32_cpu"] = agreement(cpu_ids, greedy_ids(bf16, PROMPTS))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
