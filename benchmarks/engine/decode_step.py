"""Time the engine's decode step: B sequences with P-token prompts, after their prefill.

    .venv/bin/python benchmarks/engine/decode_step.py --batch 32 --prompt-len 200 [--profile]

Prints milliseconds per step and the implied output tokens/s; --profile adds torch.profiler's table of
the ops that took the most time (grouped by input shape). Used for docs/benchmarks.md, "Engine step"."""

from __future__ import annotations

import argparse
import random
import time

from ember.engine.args import EngineArgs
from ember.engine.llm_engine import LLMEngine
from ember.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EngineArgs.model)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: CPU cores)")
    parser.add_argument("--kernels", default=EngineArgs.kernels)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=args.batch,
                                  num_threads=args.num_threads, enable_prefix_caching=False,
                                  kernels=args.kernels))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True, output_kind="final")
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(args.prompt_len)], params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.live_sequences()):
        engine.step()
    for _ in range(3):
        engine.step()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(10):
                engine.step()
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    print(f"batch {args.batch}, {args.prompt_len}-token prompts: {step_s * 1e3:.2f} ms per decode step, "
          f"{args.batch / step_s:.0f} output tok/s")


if __name__ == "__main__":
    main()
