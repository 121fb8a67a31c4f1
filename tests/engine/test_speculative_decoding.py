"""Speculative decoding by prompt lookup (--speculative-config, method ngram): the proposer's drafts, the
config's validation, greedy outputs token-identical to plain decoding and to transformers, sampled outputs
with the target distribution, and block accounting checked after every step."""

from __future__ import annotations

import random

import pytest
import torch

from ember import SamplingParams
from ember.engine.args import EngineArgs, SpeculativeConfig
from ember.engine.ngram_proposer import NgramProposer
from ember.engine.sampler import Sampler
from ember.engine.sampling_metadata import SamplingMetadata
from ember.engine.sequence import Sequence
from ember.errors import EmberError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- the proposer --------------------------------------------------------------------------------------


def test_proposes_what_followed_the_longest_most_recent_match() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # Suffix [7, 8, 9] occurred at index 1 (then 10, 11, 12); [8, 9] alone occurred later (then 50).
    tokens = [1, 7, 8, 9, 10, 11, 12, 8, 9, 50, 51, 2, 7, 8, 9]
    assert proposer.propose(tokens, max_tokens=10) == [10, 11, 12]
    # Shorter suffixes: [8, 9] matches most recently at index 7.
    assert NgramProposer(3, 1, 2).propose(tokens, max_tokens=10) == [50, 51, 2]
    assert proposer.propose(tokens, max_tokens=2) == [10, 11]  # capped by what the sequence may still emit
    assert proposer.propose(tokens, max_tokens=0) == []
    assert proposer.propose([1, 2, 3, 4], max_tokens=10) == []  # the suffix never occurred before
    assert NgramProposer(3, 2, 3).propose([5, 6, 1, 6], max_tokens=10) == []  # below prompt_lookup_min


def test_a_repeating_suffix_is_copied_forward_past_the_end() -> None:
    # Period 2: the match ends one token before the end, yet the draft runs on for all 5 tokens.
    assert NgramProposer(5, 1, 3).propose([9, 4, 5, 4, 5, 4], max_tokens=10) == [5, 4, 5, 4, 5]
    assert NgramProposer(4, 1, 3).propose([3, 3, 3], max_tokens=10) == [3, 3, 3, 3]


def test_byte_matches_that_straddle_token_boundaries_are_not_matches() -> None:
    # Little-endian int32: [256, 1] is bytes 00 01 00 00 01 00 00 00, which contains 01 00 00 00 (= [1]) at
    # byte offset 1 and [65536] (00 00 01 00) at offset 2; neither is a real token match.
    proposer = NgramProposer(2, 1, 1)
    assert proposer.propose([256, 1, 7, 5, 1], max_tokens=5) == [7, 5]
    assert proposer.propose([256, 1, 9, 65536], max_tokens=5) == []


def test_speculative_config_defaults_and_errors() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's default
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert EngineArgs(speculative_config={}).speculative_config is None
    assert EngineArgs(speculative_config='{"num_speculative_tokens": 2}').speculative_config.method == "ngram"
    for bad, message in [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer of at least 1"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys ['draft_model']"),
    ]:
        with pytest.raises(EmberError, match=message.replace("[", r"\[").replace("]", r"\]")):
            EngineArgs(speculative_config=bad)


# ---- the engine ----------------------------------------------------------------------------------------


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so that lookups find matches from the first step."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 49152) for _ in range(rng.randrange(2, 9))]
        prompts.append([rng.randrange(3, 49152) for _ in range(rng.randrange(0, 20))] + phrase * rng.randrange(2, 6))
    return prompts


def generate(llm, prompts: list[list[int]], params: SamplingParams, run_checked) -> list:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals = run_checked(engine)
    return [finals[str(i)].outputs[0] for i in range(len(prompts))]


def test_greedy_outputs_equal_plain_decoding_and_transformers(make_llm, run_checked, tiny_reference) -> None:
    prompts = repetitive_prompts(0, 12)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    speculative = make_llm(speculative_config=NGRAM, max_num_batched_tokens=64)
    engine = speculative.engine

    def accepted_drafts_are_computed(step: int) -> None:
        # The K/V of accepted drafts was written while verifying them: nothing is computed twice, and a
        # sequence that has sampled stays a one-token decode.
        for seq in engine.scheduler.running:
            if seq.num_output_tokens:
                assert seq.num_tokens - seq.num_computed_tokens == 1, seq

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals = run_checked(engine, accepted_drafts_are_computed)
    outputs = [finals[str(i)].outputs[0] for i in range(len(prompts))]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == tiny_reference(prompt, 24)
        assert output.finish_reason == "length"
    stats = speculative.engine.stats()
    assert stats.generation_tokens_total == 12 * 24
    # Blocks filled by accepted drafts went into the prefix cache with the right contents: a prompt that
    # continues a finished sequence finds all its full blocks there and continues as transformers does.
    for prompt, output in list(zip(prompts, outputs, strict=True))[:4]:
        extended = prompt + output.token_ids[:20]
        engine.add_request("again", extended, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        again = run_checked(engine)["again"]
        assert again.num_cached_tokens == (len(extended) - 1) // 16 * 16
        assert again.outputs[0].token_ids == tiny_reference(extended, 4)
    spec = stats.spec_decode
    # Both paths ran: accepted drafts (several tokens from one step) and rejected ones.
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.accepted_per_position[0] >= spec.accepted_per_position[-1] > 0
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens


def test_stops_inside_accepted_drafts_match_plain_decoding(make_llm, run_checked) -> None:
    prompts = repetitive_prompts(1, 8)
    plain = make_llm()
    speculative = make_llm(speculative_config=NGRAM)
    for params in [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # the length limit cuts a draft short
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
    ]:
        expected = generate(plain, prompts, params, run_checked)
        got = generate(speculative, prompts, params, run_checked)
        for want, have in zip(expected, got, strict=True):
            assert have.token_ids == want.token_ids
            assert have.finish_reason == want.finish_reason
            if params.logprobs is not None:
                assert [list(entry) for entry in have.logprobs] == [list(entry) for entry in want.logprobs]
                for have_entry, want_entry in zip(have.logprobs, want.logprobs, strict=True):
                    for token_id, logprob in want_entry.items():
                        assert have_entry[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
                        assert have_entry[token_id].rank == logprob.rank
    # A stop token that greedy decoding emits mid-output ends the sequence there, drafts or not.
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reference = generate(plain, prompts, params, run_checked)
    stops = [output.token_ids[10] for output in reference]
    for prompt, stop, want in zip(prompts, stops, reference, strict=True):
        stop_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
        (have,) = generate(speculative, [prompt], stop_params, run_checked)
        assert have.token_ids == want.token_ids[: want.token_ids.index(stop) + 1]  # ids keep the stop token
        assert (have.finish_reason, have.stop_reason) == ("stop", stop)



def test_a_stop_string_inside_accepted_drafts_drops_the_tokens_after_it(make_llm, run_checked) -> None:
    """The output processor finds a stop string in the middle of a step's accepted drafts: the sequence
    ends at the token that completed it, as in plain decoding."""
    prompts = repetitive_prompts(1, 2)
    plain = make_llm()
    speculative = make_llm(speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    scheduler = speculative.engine.scheduler
    finish = scheduler.finish
    dropped: list[int] = []  # tokens a stop string cut from the end of a step's accepted drafts

    def finish_and_count(seq, status, num_tokens=None):
        if num_tokens is not None:
            dropped.append(seq.num_tokens - num_tokens)
        finish(seq, status, num_tokens)

    scheduler.finish = finish_and_count
    for prompt in prompts:
        (full,) = generate(plain, [prompt], params, run_checked)
        for length in range(len(full.text) // 3, len(full.text) * 3 // 4, len(full.text) // 12):
            # A prefix of the output's own text as the stop string: it completes mid-output, where drafts are
            # being accepted, and the text before it is empty.
            stop = full.text[:length]
            stop_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
            (want,) = generate(plain, [prompt], stop_params, run_checked)
            (have,) = generate(speculative, [prompt], stop_params, run_checked)
            assert (have.token_ids, have.text) == (want.token_ids, want.text)
            assert (have.text, have.finish_reason, have.stop_reason) == ("", "stop", stop)
            assert len(have.token_ids) < len(full.token_ids)
    assert any(count > 0 for count in dropped), dropped


def test_penalized_requests_decode_without_drafts(make_llm, run_checked) -> None:
    speculative = make_llm(speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    expected = generate(make_llm(), repetitive_prompts(2, 4), params, run_checked)
    got = generate(speculative, repetitive_prompts(2, 4), params, run_checked)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert speculative.engine.stats().spec_decode.num_drafts == 0


# ---- the sampler's verification ------------------------------------------------------------------------


def test_sampled_verification_keeps_the_target_distribution() -> None:
    """With draft token 1 (probability 0.3), the first emitted token must still follow p."""
    vocab = 6
    probs = torch.tensor([0.45, 0.3, 0.15, 0.1, 0.0, 0.0])
    logits_row = probs.clamp(min=1e-30).log()
    rows = 20_000
    seqs = [Sequence("r", i, 0, [2, 3], SamplingParams(temperature=1.0)) for i in range(rows)]
    logits = logits_row.expand(2 * rows, vocab).contiguous()
    metadata = SamplingMetadata.from_sequences(seqs, [[1] for _ in range(rows)], [5], torch.device("cpu"))
    out = Sampler(torch.device("cpu"), seed=3)(logits, metadata)
    first = torch.tensor([tokens[0].token_id for tokens in out])
    frequencies = torch.bincount(first, minlength=vocab).float() / rows
    torch.testing.assert_close(frequencies, probs, atol=0.015, rtol=0)
    accepted = [tokens for tokens in out if len(tokens) == 2]  # the draft, then a token of its own
    assert len(accepted) / rows == pytest.approx(0.3, abs=0.015)
    assert all(tokens[0].token_id == 1 for tokens in accepted)
    rejected = [tokens for tokens in out if len(tokens) == 1]
    assert all(tokens[0].token_id != 1 for tokens in rejected)  # drawn from p without the draft token


def test_seeded_sampling_with_drafts_is_reproducible(make_llm, run_checked) -> None:
    prompts = repetitive_prompts(3, 4)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=11)
    first = generate(make_llm(speculative_config=NGRAM), prompts, params, run_checked)
    again = generate(make_llm(speculative_config=NGRAM, max_num_seqs=2), prompts, params, run_checked)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 16 for o in first)


def test_drafts_under_preemption_prefix_caching_forks_and_aborts(make_llm, run_checked, tiny_reference) -> None:
    """A KV cache too small for the batch: drafts are dropped rather than preempting, preempted sequences
    come back and speculate again, n=2 siblings fork from a speculating parent's prompt, and an abort
    mid-run; block accounting checked after every step, greedy outputs still transformers'."""
    tiny_block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K+V of one 16-token block of the tiny model, float32
    llm = make_llm(speculative_config=NGRAM, kv_cache_memory=20 * tiny_block_bytes / (1 << 30))
    engine = llm.engine
    prompts = repetitive_prompts(4, 10)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy)
    engine.add_request("pair", prompts[1], SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=20,
                                                          ignore_eos=True))
    engine.add_request("aborted", prompts[2], greedy)

    aborted = []

    def abort_once(step: int) -> None:
        if step == 6:
            aborted.extend(engine.abort_request("aborted"))

    finals = run_checked(engine, abort_once)
    for i, prompt in enumerate(prompts):
        assert finals[str(i)].outputs[0].token_ids == tiny_reference(prompt, 24), f"prompt {i}"
    assert [len(choice.token_ids) for choice in finals["pair"].outputs] == [20, 20]
    assert [output.outputs[0].finish_reason for output in aborted] == ["abort"]
    stats = engine.stats()
    assert stats.num_preempted_total > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks
