"""`ember profile`: how fast one replica of a model is on this machine, as a `ReplicaProfile`.

Measured offline with the LLM API, greedy, EOS ignored: TTFT (a one-token generation) for each
prompt length, and the decode step time for each batch size (the time of N tokens minus the time of
one, over N - 1 steps). A least-squares line through each gives the profile's prefill throughput and
decode step model; the points themselves are kept in the file, beside the fit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ember.control.autoscaling.replica_profile import MeasuredPoint, ReplicaProfile


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line (slope 0 through one distinct x)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return mean_y - slope * mean_x, slope


def profile_model(
    model: str,
    prompt_lengths: Sequence[int],
    batch_sizes: Sequence[int],
    decode_tokens: int = 16,
    cost_per_replica_hour: float | None = None,
    **engine_args: object,
) -> ReplicaProfile:
    from ember.engine.llm import LLM
    from ember.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    # No prefix cache: each measurement repeats its warm-up's prompts, which a cache would answer.
    llm = LLM(model=model, max_num_seqs=max(batch_sizes), enable_prefix_caching=False, **engine_args)
    cold_start_s = time.perf_counter() - started
    vocabulary = llm.engine.model_config.vocab_size

    def timed(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))  # warm this shape's kernels
        begin = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - begin

    def prompt(length: int, seed: int) -> list[int]:
        return [(seed * 7919 + i * 31) % (vocabulary - 1) + 1 for i in range(length)]

    ttft = [MeasuredPoint(x=length, seconds=timed([prompt(length, 0)], 1)) for length in prompt_lengths]
    short = min(prompt_lengths)
    step = []
    for batch in batch_sizes:
        prompts = [prompt(short, seed) for seed in range(batch)]
        elapsed = timed(prompts, decode_tokens) - timed(prompts, 1)
        step.append(MeasuredPoint(x=batch, seconds=max(elapsed, 0.0) / (decode_tokens - 1)))
    _, seconds_per_token = _line([p.x for p in ttft], [p.seconds for p in ttft])
    step_one, step_per_seq = _line([p.x - 1 for p in step], [p.seconds for p in step])
    return ReplicaProfile(
        model=model,
        prefill_tokens_per_s=1 / max(seconds_per_token, 1e-6),  # noise can make a tiny model's slope <= 0
        decode_step_s=max(step_one, 1e-6),
        decode_step_per_seq_s=max(step_per_seq, 0.0),
        max_batch=max(batch_sizes),
        cold_start_s=cold_start_s,
        cost_per_replica_hour=cost_per_replica_hour,
        ttft_by_prompt_tokens=ttft,
        step_by_batch=step,
    )
