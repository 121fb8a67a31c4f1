"""Greedy decoding is token-identical to transformers on the tiny random Llama (float32), with all 16+
prompts in one continuous batch, and stays identical under prefix-cache hits, chunked prefill,
preemption, and aborts of other requests."""

from __future__ import annotations

import random

import pytest

from ember import SamplingParams

MAX_NEW = 16
LENGTHS = [1, 3, 5, 8, 13, 15, 16, 17, 21, 31, 32, 33, 40, 47, 64, 70]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# K+V bytes of one 16-token block of the tiny model: 2 * 2 layers * 2 kv heads * 16 tokens * 16 dims * 4 bytes.
TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4


def kv_gib(num_blocks: int) -> float:
    return num_blocks * TINY_BLOCK_BYTES / (1 << 30)


def make_prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


PROMPTS = make_prompts(0, LENGTHS)


def add_all(engine, prompts, params=GREEDY, prefix="r"):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)


def assert_matches_reference(finals, prompts, tiny_reference, prefix="r", max_new=MAX_NEW):
    for i, prompt in enumerate(prompts):
        output = finals[f"{prefix}{i}"].outputs[0]
        assert output.token_ids == tiny_reference(prompt, max_new), f"prompt {i} ({len(prompt)} tokens)"
        assert output.finish_reason == "length"


def test_one_batch_matches_transformers(make_llm, run_checked, tiny_reference):
    engine = make_llm().engine
    add_all(engine, PROMPTS)
    first = engine.scheduler.schedule
    sizes = []

    def record_schedule():
        out = first()
        sizes.append(len(out.scheduled))
        return out

    engine.scheduler.schedule = record_schedule
    finals = run_checked(engine)
    assert sizes[0] == len(PROMPTS)  # every prompt prefilled in the first step: one batch
    assert all(size == len(PROMPTS) for size in sizes[: MAX_NEW])
    assert_matches_reference(finals, PROMPTS, tiny_reference)
    assert engine.stats().generation_tokens_total == len(PROMPTS) * MAX_NEW


def test_prefix_cache_hits_keep_outputs_identical(make_llm, run_checked, tiny_reference):
    engine = make_llm(enable_prefix_caching=True).engine
    shared = make_prompts(1, [40])[0]
    prompts = make_prompts(2, [1, 5, 9, 17, 24, 30, 3, 12, 7, 20, 2, 33, 11, 6, 15, 28], prefix=shared)
    add_all(engine, prompts, prefix="a")
    first = run_checked(engine)
    assert_matches_reference(first, prompts, tiny_reference, prefix="a")
    hits_after_first = engine.stats().prefix_cache_hits
    # Run the same batch again: every full prompt block now comes from the cache.
    add_all(engine, prompts, prefix="b")
    second = run_checked(engine)
    assert_matches_reference(second, prompts, tiny_reference, prefix="b")
    stats = engine.stats()
    assert stats.prefix_cache_hits > hits_after_first
    for i, prompt in enumerate(prompts):
        assert second[f"b{i}"].num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert stats.prefix_cache_queries == 2 * sum(len(p) for p in prompts)


def test_without_prefix_caching_nothing_is_shared(make_llm, run_checked, tiny_reference):
    engine = make_llm(enable_prefix_caching=False).engine
    prompts = PROMPTS[-4:]
    for round_ in range(2):
        add_all(engine, prompts, prefix=f"x{round_}-")
        assert_matches_reference(run_checked(engine), prompts, tiny_reference, prefix=f"x{round_}-")
    assert engine.stats().prefix_cache_hits == 0
    assert all(output is None for output in engine.block_manager.block_hash)


def test_chunked_prefill_with_a_tiny_token_budget(make_llm, run_checked, tiny_reference):
    engine = make_llm(max_num_batched_tokens=8, enable_prefix_caching=False).engine
    add_all(engine, PROMPTS)
    budgets = []
    schedule = engine.scheduler.schedule

    def record_schedule():
        out = schedule()
        budgets.append(out.num_batched_tokens)
        assert sum(item.num_new_tokens for item in out.scheduled) == out.num_batched_tokens <= 8
        return out

    engine.scheduler.schedule = record_schedule
    finals = run_checked(engine)
    assert_matches_reference(finals, PROMPTS, tiny_reference)
    assert len(budgets) > sum(LENGTHS) // 8


def test_preemption_from_a_tiny_kv_cache(make_llm, run_checked, tiny_reference):
    engine = make_llm(kv_cache_memory=kv_gib(24), enable_prefix_caching=False).engine
    assert engine.runner.num_blocks == 24
    add_all(engine, PROMPTS)
    finals = run_checked(engine)
    assert_matches_reference(finals, PROMPTS, tiny_reference)
    stats = engine.stats()
    assert stats.num_preempted_total > 0
    assert sum(out.metrics.num_preemptions for out in finals.values()) == stats.num_preempted_total
    assert stats.num_free_blocks == 24


def test_preemption_with_prefix_caching_and_priorities(make_llm, run_checked, tiny_reference):
    engine = make_llm(kv_cache_memory=kv_gib(20)).engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY, priority=i % 3)
    finals = run_checked(engine)
    assert_matches_reference(finals, PROMPTS, tiny_reference)
    assert engine.stats().num_preempted_total > 0


def test_aborts_mid_batch_leave_the_others_unaffected(make_llm, run_checked, tiny_reference):
    engine = make_llm().engine
    add_all(engine, PROMPTS)
    aborted = {"r2", "r7", "r11", "r15"}
    abort_outputs = []

    def abort_some(step: int) -> None:
        if step == 3:
            abort_outputs.extend(engine.abort_request(sorted(aborted)))
            engine.check_invariants()

    finals = run_checked(engine, on_step=abort_some)
    assert {out.request_id for out in abort_outputs} == aborted
    for out in abort_outputs:
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert 0 < len(out.outputs[0].token_ids) < MAX_NEW
        assert out.request_id not in finals
    kept = [i for i in range(len(PROMPTS)) if f"r{i}" not in aborted]
    for i in kept:
        assert finals[f"r{i}"].outputs[0].token_ids == tiny_reference(PROMPTS[i], MAX_NEW)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_requests_finished["abort"] == len(aborted)


def test_stop_token_ids_and_stop_strings_end_greedy_runs(make_llm, run_checked, tiny_reference, tiny_model_dir):
    engine = make_llm().engine
    # A prompt whose greedy continuation has a token first appearing at position >= 3.
    prompt, reference, stop_at = next(
        (p, ref, i) for p in PROMPTS for ref in [tiny_reference(p, MAX_NEW)]
        for i in range(3, MAX_NEW - 2) if ref[i] not in ref[:i]
    )
    engine.add_request("tok", prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                     stop_token_ids=[reference[stop_at]]))
    tokenizer = engine.tokenizer
    stop_text = tokenizer.decode(reference[stop_at:stop_at + 2])
    engine.add_request("str", prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop_text]))
    finals = run_checked(engine)
    by_token = finals["tok"].outputs[0]
    assert by_token.token_ids == reference[: stop_at + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", reference[stop_at])
    assert by_token.text == tokenizer.decode(reference[:stop_at])
    by_string = finals["str"].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop_text)
    full = tokenizer.decode(reference)
    assert by_string.text == full[: full.index(stop_text)]
    assert reference[: len(by_string.token_ids)] == by_string.token_ids


@pytest.mark.parametrize("n", [2, 3])
def test_n_greedy_completions_share_the_prompt_blocks(make_llm, run_checked, tiny_reference, n):
    engine = make_llm(enable_prefix_caching=False).engine
    prompt = PROMPTS[14]  # 64 tokens: 3 full blocks shared (the 4th is recomputed by each sibling)
    engine.add_request("n", prompt, SamplingParams(n=n, temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    shared_refs = []

    def watch(step: int) -> None:
        request = engine.requests.get("n")
        if request is not None and all(seq is not None for seq in request.seqs):
            shared_refs.append([engine.block_manager.ref_counts[b] for b in request.seqs[0].block_table[:3]])

    finals = run_checked(engine, on_step=watch)
    assert shared_refs and shared_refs[0] == [n, n, n]
    outputs = finals["n"].outputs
    assert [out.index for out in outputs] == list(range(n))
    for out in outputs:
        assert out.token_ids == tiny_reference(prompt, MAX_NEW) and out.finish_reason == "length"
