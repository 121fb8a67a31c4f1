"""SamplingParams.prompt_logprobs: every prompt token's logprob, rank and top-k under the model, equal to
transformers' on the tiny float32 model, whether the prompt is prefilled in one step or in chunks, behind
a prefix-cache hit, for n=2, or recomputed after preemption; scored exactly once."""

from __future__ import annotations

import random

import pytest
import torch

from ember import SamplingParams

TOP = 3


def reference_scores(hf_tiny, prompt: list[int]) -> list[tuple[float, int, list[int]]]:
    """(logprob, rank, top-3 ids) of prompt[i] given prompt[:i], for i >= 1, by transformers."""
    with torch.inference_mode():
        logits = hf_tiny(torch.tensor([prompt])).logits[0].float()
    logprobs = logits.log_softmax(-1)
    scores = []
    for i in range(1, len(prompt)):
        row = logprobs[i - 1]
        token = prompt[i]
        rank = int((row > row[token]).sum()) + 1
        scores.append((float(row[token]), rank, row.topk(TOP).indices.tolist()))
    return scores


def assert_scores(prompt_logprobs, prompt: list[int], hf_tiny) -> None:
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i, (entry, (logprob, rank, top)) in enumerate(zip(prompt_logprobs[1:], reference_scores(hf_tiny, prompt),
                                                          strict=True), start=1):
        token = prompt[i]
        assert entry[token].logprob == pytest.approx(logprob, abs=1e-4), f"position {i}"
        assert entry[token].rank == rank
        # The entry holds the prompt token and the top 3, each with its rank.
        assert {t for t, lp in entry.items() if lp.rank <= TOP} == set(top)
        assert sorted(lp.rank for t, lp in entry.items() if t in top) == list(range(1, TOP + 1))


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("budget", [1024, 16], ids=["one-step", "chunked"])
def test_prompt_logprobs_match_transformers(make_llm, run_checked, hf_tiny, budget: int) -> None:
    engine = make_llm(max_num_batched_tokens=budget).engine
    batch = prompts(0, [2, 17, 40, 5])
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, params)
    engine.add_request("plain", batch[1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    finals = run_checked(engine)
    for i, prompt in enumerate(batch):
        assert_scores(finals[str(i)].prompt_logprobs, prompt, hf_tiny)
    assert finals["plain"].prompt_logprobs is None
    assert finals["1"].outputs[0].token_ids == finals["plain"].outputs[0].token_ids


def test_prompt_logprobs_behind_the_prefix_cache_for_forks_and_after_preemption(make_llm, run_checked, hf_tiny):
    tiny_block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K+V of one 16-token block of the tiny model, float32
    engine = make_llm(kv_cache_memory=12 * tiny_block_bytes / (1 << 30)).engine
    prompt = prompts(1, [50])[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm", prompt, greedy)
    run_checked(engine)  # the prompt's blocks are now in the prefix cache
    scored = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("scored", prompt, scored)
    engine.add_request("pair", prompt, SamplingParams(n=2, temperature=0.0, max_tokens=30, ignore_eos=True,
                                                      prompt_logprobs=0))
    for i, other in enumerate(prompts(2, [40, 40])):  # crowd the 12 blocks: someone gets preempted
        engine.add_request(f"other{i}", other, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    finals = run_checked(engine)
    assert engine.stats().num_preempted_total > 0
    for name in ("scored", "pair"):
        assert finals[name].num_cached_tokens == 0  # scoring needs every position's logits: no cache hit
        entries = finals[name].prompt_logprobs
        assert len(entries) == len(prompt)  # scored once, however often the prompt was computed
        for i, (entry, (logprob, _, _)) in enumerate(zip(entries[1:], reference_scores(hf_tiny, prompt),
                                                         strict=True), start=1):
            assert entry[prompt[i]].logprob == pytest.approx(logprob, abs=1e-4)
    assert [len(choice.token_ids) for choice in finals["pair"].outputs] == [30, 30]
