"""Logprobs against transformers, seeded sampling reproducibility, output kinds, finish rules, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from ember import SamplingParams
from ember.engine.errors import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    InvalidTokenIdError,
    PromptTooLongError,
)

# float32 on both sides; the only difference is batched vs single-sequence accumulation order.
LOGPROB_TOLERANCE = 1e-4


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def test_logprobs_match_transformers_log_softmax(tiny_llm, hf_tiny, run_checked):
    engine = tiny_llm.engine
    prompts = random_prompts(5, [4, 19, 33, 50])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"lp{i}", prompt, params)
    finals = run_checked(engine)
    for i, prompt in enumerate(prompts):
        out = finals[f"lp{i}"].outputs[0]
        full = torch.tensor([prompt + out.token_ids])
        with torch.inference_mode():
            reference = torch.log_softmax(hf_tiny(full).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        assert len(out.logprobs) == len(out.token_ids) == 8
        total = 0.0
        for step, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            ref = reference[step]
            assert entry[token_id].logprob == pytest.approx(ref[token_id].item(), abs=LOGPROB_TOLERANCE)
            assert entry[token_id].rank == 1  # greedy picks the most likely token
            top_values, top_ids = ref.topk(3)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            assert [token for token, _ in ranked] == top_ids.tolist()
            for (token, logprob), value in zip(ranked, top_values.tolist(), strict=True):
                assert logprob.logprob == pytest.approx(value, abs=LOGPROB_TOLERANCE)
                assert logprob.decoded_token == engine.tokenizer.decode([token], skip_special_tokens=False)
            total += entry[token_id].logprob
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_logprobs_zero_returns_only_the_sampled_token(tiny_llm):
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=1, max_tokens=5, logprobs=0))[0]
    completion = out.outputs[0]
    assert [list(entry) for entry in completion.logprobs] == [[t] for t in completion.token_ids]
    assert all(entry[t].rank >= 1 for t, entry in zip(completion.token_ids, completion.logprobs, strict=True))
    plain = tiny_llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_seeded_sampling_is_reproducible_across_runs_and_batch_compositions(tiny_llm):
    prompt = random_prompts(7, [12])[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tiny_llm.generate([prompt], seeded)[0].outputs[0].token_ids
    assert tiny_llm.generate([prompt], seeded)[0].outputs[0].token_ids == alone
    others = random_prompts(8, [3, 40, 17, 25, 9])
    mixed_params = [
        SamplingParams(temperature=1.0, max_tokens=12),
        SamplingParams(temperature=0.7, seed=99, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=1.3, top_k=50, max_tokens=12),
        SamplingParams(temperature=1.0, seed=1234, max_tokens=3),
    ]
    for position in (0, 3, 5):
        prompts = others[:position] + [prompt] + others[position:]
        params = mixed_params[:position] + [seeded] + mixed_params[position:]
        outputs = tiny_llm.generate(prompts, params)
        assert outputs[position].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=12, ignore_eos=True)
    assert tiny_llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone


def test_seeded_siblings_draw_from_seed_plus_index(tiny_llm):
    prompt = random_prompts(9, [30])[0]
    base = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    both = tiny_llm.generate([prompt], SamplingParams(n=2, seed=50, **base))[0].outputs
    first = tiny_llm.generate([prompt], SamplingParams(seed=50, **base))[0].outputs[0]
    second = tiny_llm.generate([prompt], SamplingParams(seed=51, **base))[0].outputs[0]
    assert [out.token_ids for out in both] == [first.token_ids, second.token_ids]
    assert first.token_ids != second.token_ids


def test_delta_outputs_concatenate_to_the_cumulative_result(tiny_llm, run_checked):
    engine = tiny_llm.engine
    prompt = random_prompts(11, [20])[0]
    deltas_text, deltas_tokens, counts = [], [], []
    engine.add_request("d", prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                                                   output_kind="delta", logprobs=1))
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            deltas_text.append(completion.text)
            deltas_tokens += completion.token_ids
            counts.append(len(completion.logprobs))
    full = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))[0]
    assert deltas_tokens == full.outputs[0].token_ids
    assert "".join(deltas_text) == full.outputs[0].text
    assert sum(counts) == 14 and len(counts) == 14


def test_cumulative_outputs_stream_every_step_and_final_only_once(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("c", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("f", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                      output_kind="final"))
    seen: dict[str, list[int]] = {"c": [], "f": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(len(output.outputs[0].token_ids))
    assert seen == {"c": [1, 2, 3, 4], "f": [4]}


def test_min_tokens_and_max_model_len(make_llm, tiny_reference):
    llm = make_llm(max_model_len=40)
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_ids[0]
    prompt = random_prompts(12, [30])[0]
    # max_tokens beyond max_model_len: cut at max_model_len with reason "length".
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    # A stop token id that greedy decoding produces early is suppressed until min_tokens outputs exist.
    reference = tiny_reference(prompt, 8)
    stop_token = reference[1]
    early = llm.generate([prompt], SamplingParams(temperature=0, stop_token_ids=[stop_token]))[0].outputs[0]
    assert early.token_ids == reference[:2] and early.stop_reason == stop_token
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=6,
                                                 stop_token_ids=[stop_token, eos]))[0].outputs[0]
    assert len(late.token_ids) == 6 and stop_token not in late.token_ids and eos not in late.token_ids
    assert late.finish_reason == "length"


def test_bad_requests_raise_typed_errors_naming_the_problem(make_llm, tiny_llm):
    engine = make_llm(max_model_len=32).engine
    with pytest.raises(PromptTooLongError, match="maximum context length is 32 tokens") as raised:
        engine.add_request("long", list(range(3, 40)))
    assert (raised.value.param, raised.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(EmptyPromptError, match="prompt is empty") as raised:
        engine.add_request("empty", [])
    assert raised.value.param == "prompt"
    vocab_size = engine.model_config.vocab_size
    out_of_range = rf"Token id {10**6} is out of range \(vocabulary size {vocab_size}\)"
    with pytest.raises(InvalidTokenIdError, match=out_of_range):
        engine.add_request("vocab", [1, 10**5, 10**6])
    with pytest.raises(InvalidTokenIdError, match="Token id -1 is out of range"):
        engine.add_request("negative", [1, -1, 10**6])
    with pytest.raises(InvalidRequestError, match="exceeds max_num_seqs") as raised:
        engine.add_request("n", [1, 2], SamplingParams(n=1000))
    assert raised.value.param == "n"
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [1, 2])
    assert [o.outputs[0].finish_reason for o in engine.abort_request("dup")] == ["abort"]
    for field, value in [("temperature", -1), ("top_p", 0), ("top_k", -5), ("max_tokens", 0),
                         ("n", 0), ("logprobs", -1), ("min_p", 2), ("output_kind", "x")]:
        with pytest.raises(InvalidSamplingParamsError, match=field) as raised:
            SamplingParams(**{field: value})
        assert raised.value.param == field
    with pytest.raises(InvalidSamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    # Typed errors stay ValueErrors, so callers that caught those keep working.
    assert issubclass(InvalidRequestError, ValueError)
    assert not engine.has_unfinished_requests()
