"""Turns each sampled row's logits into the next token: min_tokens, penalties, temperature, top-k/top-p/min-p,
then a draw from the sequence's own generator (seeded requests) or the runner's generator.

Work a batch does not need is skipped: an all-greedy batch without penalties is one argmax. Logprobs are
those of the raw model logits (before penalties and temperature), like vLLM's default."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from ember.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    # The rest only when the request asked for logprobs (None otherwise):
    logprob: float | None  # log_softmax of the raw model logits
    rank: int | None  # 1 = the most likely token under the raw logits
    top_logprobs: list[tuple[int, float]] | None  # params.logprobs most likely (token, logprob)


class Sampler:
    def __init__(self, eos_token_ids: SequenceOf[int], device: torch.device, seed: int) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        # Draws for requests without a seed: one generator per runner, so a run is reproducible from args.seed.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """logits: float32 [N, V], row i belongs to seqs[i] (whose token_ids hold prompt + output so far)."""
        raw = logits
        logits = self._apply_min_tokens(logits, seqs)
        logits = self._apply_penalties(logits, seqs)
        token_ids = self._choose(logits, seqs, _argmax(logits))
        sampled = [SampledToken(token_id, None, None, None) for token_id in token_ids.tolist()]
        # The log-normalizer over the whole vocabulary is the sampler's dearest step: only for rows that ask.
        logprob_rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if logprob_rows:
            for row, token in zip(logprob_rows, self._logprobs(raw, token_ids, seqs, logprob_rows), strict=True):
                sampled[row] = token
        return sampled

    def _logprobs(self, raw: torch.Tensor, token_ids: torch.Tensor, seqs: list[Sequence],
                  rows: list[int]) -> list[SampledToken]:
        """The chosen token's logprob and rank and the top logprobs, under the raw logits, for `rows`."""
        if len(rows) < len(seqs):
            raw, token_ids = raw[rows], token_ids[rows]
        log_norm = torch.logsumexp(raw, dim=-1)
        chosen_raw = raw.gather(1, token_ids[:, None])
        logprobs = (chosen_raw[:, 0] - log_norm).tolist()
        ranks = ((raw > chosen_raw).sum(dim=-1) + 1).tolist()
        wanted = [seqs[row].params.logprobs or 0 for row in rows]
        k = min(max(wanted), raw.shape[1])
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        if k:
            values, indices = raw.topk(k, dim=-1)
            values_list = (values - log_norm[:, None]).tolist()
            indices_list = indices.tolist()
            top = [list(zip(indices_list[i][:count], values_list[i][:count], strict=True))
                   for i, count in enumerate(wanted)]
        return [SampledToken(token_id, logprob, rank, row_top) for token_id, logprob, rank, row_top
                in zip(token_ids.tolist(), logprobs, ranks, top, strict=True)]

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Until min_tokens outputs exist, EOS (unless ignore_eos, where it never stops anyway) and the stop
        token ids cannot be sampled."""
        rows, banned = [], []
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.min_tokens and seq.num_output_tokens < params.min_tokens:
                ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
                rows += [row] * len(ids)
                banned += ids
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows, device=self.device), torch.tensor(banned, device=self.device)] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        repetition = [row for row, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
        additive = [row for row, seq in enumerate(seqs)
                    if seq.params.presence_penalty != 0.0 or seq.params.frequency_penalty != 0.0]
        if not repetition and not additive:
            return logits
        logits = logits.clone()
        if repetition:
            # Hugging Face semantics over prompt + output: divide positive logits, multiply negative ones.
            index = self._padded_ids(rows=repetition, seqs=seqs, output_only=False)
            penalty = self._param_column(seqs, repetition, "repetition_penalty")
            sub = logits[repetition]
            seen = sub.gather(1, index)
            sub.scatter_(1, index, torch.where(seen > 0, seen / penalty, seen * penalty))
            logits[repetition] = sub
        if additive:
            # OpenAI semantics over output tokens: subtract frequency * count + presence * (count > 0).
            index = self._padded_ids(rows=additive, seqs=seqs, output_only=True)
            counts = torch.zeros(len(additive), logits.shape[1], device=self.device)
            lengths = torch.tensor([seqs[row].num_output_tokens for row in additive], device=self.device)
            valid = torch.arange(index.shape[1], device=self.device)[None, :] < lengths[:, None]
            counts.scatter_add_(1, index, valid.float())
            frequency = self._param_column(seqs, additive, "frequency_penalty")
            presence = self._param_column(seqs, additive, "presence_penalty")
            logits[additive] -= frequency * counts + presence * (counts > 0).float()
        return logits

    def _padded_ids(self, rows: list[int], seqs: list[Sequence], output_only: bool) -> torch.Tensor:
        """[len(rows), longest] token ids per row, padded with the row's first id (or 0 when it has none)."""
        lists = [seqs[row].output_token_ids if output_only else seqs[row].token_ids for row in rows]
        width = max(1, max(len(ids) for ids in lists))
        padded = [ids + [ids[0] if ids else 0] * (width - len(ids)) for ids in lists]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _param_column(self, seqs: list[Sequence], rows: list[int], name: str) -> torch.Tensor:
        return torch.tensor([[getattr(seqs[row].params, name)] for row in rows], device=self.device)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids holds each row's argmax; rows with a temperature get a random draw instead."""
        random_rows = [row for row, seq in enumerate(seqs) if seq.params.temperature != 0.0]
        if not random_rows:
            return token_ids
        params = [seqs[row].params for row in random_rows]
        logits = logits[random_rows]
        logits = logits / torch.tensor([[p.temperature] for p in params], device=self.device)
        if any(p.top_k for p in params):
            logits = _apply_top_k(logits, [p.top_k for p in params])
        probs = logits.softmax(dim=-1)
        if any(p.top_p < 1.0 for p in params):
            # top_p == 1 keeps everything (a threshold of 1.0 could drop the tail to rounding in the cumsum).
            top_p = [[p.top_p if p.top_p < 1.0 else float("inf")] for p in params]
            probs = _apply_top_p(probs, torch.tensor(top_p, device=self.device))
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([[p.min_p] for p in params], device=self.device)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (renormalization is unnecessary).
        # Each seeded row draws its noise from its own generator, so its samples do not depend on the batch.
        noise = torch.empty_like(probs)
        unseeded = []
        for i, row in enumerate(random_rows):
            generator = seqs[row].generator
            if generator is None:
                unseeded.append(i)
            else:
                noise[i] = torch.empty(probs.shape[1], device=generator.device).exponential_(generator=generator)
        if unseeded:
            if len(unseeded) == len(random_rows):
                noise.exponential_(generator=self.generator)
            else:
                noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=self.device).exponential_(
                    generator=self.generator
                )
        # A zero draw means "arrives first"; keep it finite so a zero probability never wins by 0 / 0.
        token_ids[random_rows] = _argmax(probs / noise.clamp_(min=1e-30))
        return token_ids


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keep each row's top_k largest logits (0 = all)."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    largest = logits.topk(max(ks), dim=-1).values
    kth = largest.gather(1, torch.tensor([[k - 1] for k in ks], device=logits.device))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def _argmax(rows: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, the first one on ties, like argmax: max(dim).indices is the same
    reduction ~2.5x faster on CPU (0.44 vs 1.15 ms for [32, 49152] float32, 2 threads)."""
    return rows.max(dim=-1).indices
