"""Sampler semantics on small hand-made logits: greedy, top-k/top-p/min-p, seeds, penalties, min_tokens,
logprobs. The sampler reads the SamplingMetadata gathered from the sequences, as the model runner does."""

from __future__ import annotations

import math

import pytest
import torch

from ember.engine.sampler import SampledToken, Sampler
from ember.engine.sampling_metadata import SamplingMetadata
from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import Sequence

EOS = 7
VOCAB = 10


def make_seq(prompt: list[int] | None = None, output: list[int] | None = None, seed: int | None = None,
             **params) -> Sequence:
    sampling = SamplingParams(seed=seed, **params)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    seq = Sequence("r", 0, 0, prompt or [1, 2, 3], sampling, generator=generator)
    seq.token_ids += output or []
    return seq


def metadata(seqs: list[Sequence]) -> SamplingMetadata:
    return SamplingMetadata.from_sequences(seqs, [[] for _ in seqs], [EOS], torch.device("cpu"))


class OneTokenPerRow:
    """The sampler on rows without draft tokens, where every sequence gains exactly one token."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        out = self.sampler(logits, metadata(seqs))
        assert [len(tokens) for tokens in out] == [1] * len(seqs)
        return [tokens[0] for tokens in out]


@pytest.fixture
def sampler() -> OneTokenPerRow:
    return OneTokenPerRow(Sampler(torch.device("cpu"), seed=0))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_one_is_greedy(sampler: OneTokenPerRow) -> None:
    logits = random_logits(6)
    greedy = sampler(logits, [make_seq(temperature=0.0) for _ in range(6)])
    top1 = sampler(logits, [make_seq(temperature=1.5, top_k=1) for _ in range(6)])
    expected = logits.argmax(dim=-1).tolist()
    assert [t.token_id for t in greedy] == expected
    assert [t.token_id for t in top1] == expected
    assert all(t.rank is None for t in greedy)
    assert [t.rank for t in sampler(logits, [make_seq(temperature=0.0, logprobs=0) for _ in range(6)])] == [1] * 6


def test_greedy_ties_pick_the_lowest_token_id(sampler: OneTokenPerRow) -> None:
    """bfloat16 logits tie often; the choice must not depend on the reduction's thread split."""
    logits = torch.zeros(3, 40000)
    logits[0, [5, 900, 39999]] = 2.0
    logits[1, [31000, 12]] = 1.0
    chosen = sampler(logits, [make_seq(temperature=0.0) for _ in range(3)])
    assert [t.token_id for t in chosen] == [5, 12, 0]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(sampler: OneTokenPerRow) -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: every draw depends only on the generator

    def draws(batch_mates: int, steps: int = 12) -> list[int]:
        seq = make_seq(seed=1234, temperature=1.0)
        tokens = []
        for step in range(steps):
            others = [make_seq(seed=step + j, temperature=0.7) for j in range(batch_mates)]
            others += [make_seq(temperature=1.0) for _ in range(batch_mates)]
            batch = others[:batch_mates] + [seq] + others[batch_mates:]
            out = sampler(torch.cat([random_logits(batch_mates, step), logits, random_logits(batch_mates, 9)]), batch)
            tokens.append(out[batch_mates].token_id)
            seq.token_ids.append(tokens[-1])
        return tokens

    alone = draws(0)
    assert alone == draws(0)
    assert alone == draws(3)
    assert len(set(alone)) > 3  # really random, not a constant
    other_seed = make_seq(seed=4321, temperature=1.0)
    assert [sampler(logits, [other_seed])[0].token_id for _ in range(12)] != alone


def test_unseeded_sampling_follows_the_softmax_distribution() -> None:
    sampler = OneTokenPerRow(Sampler(torch.device("cpu"), seed=5))
    base = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    rows = 4000
    out = sampler(base.expand(rows, VOCAB), [make_seq(temperature=0.5) for _ in range(rows)])
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=VOCAB).float() / rows
    expected = (base[0] / 0.5).softmax(-1)
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)


def test_top_p_min_p_and_top_k_restrict_the_candidates(sampler: OneTokenPerRow) -> None:
    # probabilities 0.5, 0.3, 0.2 (the rest ~0)
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)] + [-1e4] * (VOCAB - 3)])
    rows = 300

    def sampled(**params) -> set[int]:
        out = sampler(logits.expand(rows, VOCAB), [make_seq(temperature=1.0, **params) for _ in range(rows)])
        return {t.token_id for t in out}

    assert sampled() == {0, 1, 2}
    assert sampled(top_p=0.75) == {0, 1}
    assert sampled(top_p=0.5) == {0}
    assert sampled(top_k=2) == {0, 1}
    assert sampled(min_p=0.5) == {0, 1}  # 0.2 < 0.5 * 0.5
    assert sampled(min_p=0.7) == {0}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(sampler: OneTokenPerRow) -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, -1.5, 0.5, 0, 0, 0, 0, 0]])
    seq = make_seq(prompt=[0, 1], output=[4, 4], repetition_penalty=2.0)
    penalized = sampler.sampler._apply_penalties(logits, metadata([seq]))
    expected = torch.tensor([[1.0, -2.0, 1.5, -1.5, 0.25, 0, 0, 0, 0, 0]])
    torch.testing.assert_close(penalized, expected)
    assert logits[0, 0] == 2.0  # the raw logits are untouched (logprobs use them)
    assert sampler(logits, [make_seq(prompt=[0], temperature=0.0, repetition_penalty=2.0)])[0].token_id == 2
    assert sampler(logits, [make_seq(prompt=[0], temperature=0.0, repetition_penalty=1.3)])[0].token_id == 0


def test_presence_and_frequency_penalties_count_output_tokens_only(sampler: OneTokenPerRow) -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0, 0, 0, 0, 0, 0, 0]])
    seqs = [
        make_seq(prompt=[1, 1, 1], output=[0, 0, 2], frequency_penalty=0.5, presence_penalty=0.25),
        make_seq(prompt=[0, 0], output=[], frequency_penalty=1.0, presence_penalty=1.0),
        make_seq(prompt=[5], output=[2, 2, 2, 2], frequency_penalty=-0.5),
    ]
    penalized = sampler.sampler._apply_penalties(logits.expand(3, VOCAB), metadata(seqs))
    expected = logits.expand(3, VOCAB).clone()
    expected[0, 0] = 3.0 - 2 * 0.5 - 0.25
    expected[0, 2] = 1.0 - 1 * 0.5 - 0.25
    expected[2, 2] = 1.0 + 4 * 0.5
    torch.testing.assert_close(penalized, expected)
    assert [t.token_id for t in sampler(logits.expand(3, VOCAB), [
        make_seq(output=[0, 0], temperature=0.0, frequency_penalty=0.4),
        make_seq(output=[0, 0], temperature=0.0, frequency_penalty=0.6),
        make_seq(output=[0], temperature=0.0, presence_penalty=1.5),
    ])] == [0, 1, 1]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(sampler: OneTokenPerRow) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 5.0
    logits[0, 3] = 4.0
    logits[0, 8] = 3.0

    def greedy(**params) -> int:
        return sampler(logits, [make_seq(temperature=0.0, **params)])[0].token_id

    assert greedy() == EOS
    assert greedy(min_tokens=2, output=[4]) == 3
    assert greedy(min_tokens=2, output=[4], stop_token_ids=[3]) == 8
    assert greedy(min_tokens=2, output=[4, 4]) == EOS
    assert greedy(min_tokens=2, output=[4], ignore_eos=True) == EOS  # ignore_eos: EOS never stops anyway


def test_logprobs_are_raw_log_softmax_with_sorted_ranked_top_logprobs(sampler: OneTokenPerRow) -> None:
    logits = random_logits(3, seed=7)
    seqs = [
        make_seq(seed=3, temperature=2.0, logprobs=4, repetition_penalty=1.7, output=[int(logits[0].argmax())]),
        make_seq(temperature=0.0, logprobs=0),
        make_seq(temperature=0.0),
    ]
    out = sampler(logits, seqs)
    reference = logits.log_softmax(dim=-1)
    for row, token in enumerate(out[:2]):
        assert token.logprob == pytest.approx(reference[row, token.token_id].item(), abs=1e-5)
        assert token.rank == int((reference[row] > reference[row, token.token_id]).sum()) + 1
    assert out[0].rank > 1  # the penalty and temperature moved the draw off the raw argmax, logprobs stay raw
    assert out[2].logprob is None and out[2].rank is None  # not asked: the vocabulary-wide normalizer is skipped
    top = out[0].top_logprobs
    values, indices = reference[0].topk(4)
    assert [t for t, _ in top] == indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-5)
    assert out[1].top_logprobs == [] and out[2].top_logprobs is None
