"""Time the engine's decode step: B sequences with P-token prompts, after their prefill.

    .venv/bin/python benchmarks/engine/decode_step.py --batch 32 --prompt-len 200 [--draft-tokens K] [--profile]

Prints milliseconds per step (model forward, LM head, sampler and the rest) and the implied output
tokens/s; --draft-tokens gives every decode K speculative tokens to verify (repeats of its last token,
mostly rejected: the cost of a verification step, not its gain); --profile adds torch.profiler's table of
the ops that took the most time (grouped by input shape). Used for docs/benchmarks.md, "Engine step"."""

from __future__ import annotations

import argparse
import collections
import random
import time

from ember.engine.args import EngineArgs
from ember.engine.llm_engine import LLMEngine
from ember.engine.outputs import SpecDecodeStats
from ember.engine.sampling_params import SamplingParams
from ember.kernels import KERNEL_CHOICES


class RepeatLastToken:
    """A proposer whose drafts are the last token repeated: a verification step of a fixed size."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return token_ids[-1:] * min(self.num_tokens, max_tokens)


def time_calls(obj: object, name: str, totals: collections.Counter) -> None:
    call = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = call(*args, **kwargs)
        totals[name] += time.perf_counter() - start
        return result

    setattr(obj, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EngineArgs.model)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: CPU cores)")
    parser.add_argument("--kernels", default="auto", choices=KERNEL_CHOICES, help="native kernels (ember serve --kernels)")
    parser.add_argument("--quantization", default="none", help="none, gguf or int8 (ember serve --quantization)")
    parser.add_argument("--draft-tokens", type=int, default=0, help="draft tokens each decode verifies")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=args.batch,
                                  num_threads=args.num_threads, enable_prefix_caching=False,
                                  kernels=args.kernels, quantization=args.quantization))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True, output_kind="final")
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(args.prompt_len)], params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.live_sequences()):
        engine.step()
    if args.draft_tokens:
        engine.scheduler.proposer = RepeatLastToken(args.draft_tokens)
        engine.scheduler.spec_stats = SpecDecodeStats(accepted_per_position=[0] * args.draft_tokens)
    for _ in range(3):
        engine.step()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(10):
                engine.step()
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))
    totals: collections.Counter = collections.Counter()
    runner = engine.runner
    time_calls(runner.model, "forward", totals)
    time_calls(runner.model, "compute_logits", totals)
    time_calls(runner, "sampler", totals)
    generated = engine.stats().generation_tokens_total
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    tokens_per_step = (engine.stats().generation_tokens_total - generated) / args.steps
    parts = {name: totals[name] / args.steps * 1e3 for name in ("forward", "compute_logits", "sampler")}
    parts["rest"] = step_s * 1e3 - sum(parts.values())
    print(f"batch {args.batch}, {args.prompt_len}-token prompts, {args.draft_tokens} draft tokens: "
          f"{step_s * 1e3:.2f} ms per step ({', '.join(f'{k} {v:.2f}' for k, v in parts.items())}), "
          f"{tokens_per_step / step_s:.0f} output tok/s")


if __name__ == "__main__":
    main()
