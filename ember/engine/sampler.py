"""Turns each sampled row's logits into the next token: min_tokens, penalties, temperature, top-k/top-p/min-p,
then a draw from the sequence's own generator (seeded requests) or the runner's generator. A decode with
speculative draft tokens has one row per position and is verified here (accept a run of drafts, then draw).

Rows decoding under a grammar first lose the tokens it does not allow. Work a batch does not need is
skipped: an all-greedy batch without penalties or grammars is one argmax. Logprobs are
those of the raw model logits (before penalties and temperature), like vLLM's default."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.engine.sampling_metadata import SamplingMetadata
from ember.engine.structured_output.grammar import apply_bitmask
from ember.kernels.native import NativeKernels


@dataclass
class SampledToken:
    token_id: int
    # The rest only when the request asked for logprobs (None otherwise):
    logprob: float | None  # log_softmax of the raw model logits
    rank: int | None  # 1 = the most likely token under the raw logits
    top_logprobs: list[tuple[int, float]] | None  # params.logprobs most likely (token, logprob)


class Sampler:
    def __init__(self, device: torch.device, seed: int, native: NativeKernels | None = None) -> None:
        self.device = device
        self.native = native  # its argmax takes logits of the model's dtype at memory speed
        # Draws for requests without a seed: one generator per runner, so a run is reproducible from args.seed.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> list[list[SampledToken]]:
        """logits: [R, V], float32 or the model dtype (upcast here unless only argmaxes are needed); the grammar
        rows' disallowed tokens are set to -inf in it, in place unless logprobs are asked for; sequence i
        owns 1 + len(metadata.drafts[i]) consecutive rows from metadata.starts[i]: the logits after its last
        token, then after each of its draft tokens.

        Returns each sequence's new tokens: the draft tokens it accepts, then one token of its own, drawn at
        the first rejected position (or after the last draft). Greedy rows accept a draft token that is the
        argmax; sampled rows accept it with its probability and draw a rejection from the rest, which keeps
        the output distribution exactly that of plain decoding (speculative sampling with a one-token
        proposal). Rows with drafts must not have penalties or pending min_tokens: those depend on the
        tokens before each row, which the engine leaves to draft-free decoding."""
        drafts, starts = metadata.drafts, metadata.starts
        raw = logits
        # Masked before the upcast: one pass over the model dtype's logits (-inf stays -inf in float32).
        logits = self._apply_grammar(logits, metadata)
        if logits.dtype != torch.float32 and metadata.needs_float32:
            logits = logits.float()
        logits = self._apply_min_tokens(logits, metadata)
        logits = self._apply_penalties(logits, metadata)
        if self.native is not None and logits.dtype == self.native.dtype and logits.is_contiguous():
            ids = self.native.argmax(logits).tolist()
        else:
            ids = _argmax(logits).tolist()
        accepted = [
            _matching_prefix(draft, ids, start) if draft and greedy else 0
            for draft, start, greedy in zip(drafts, starts, metadata.greedy, strict=True)
        ]
        random_seqs = [i for i, greedy in enumerate(metadata.greedy) if not greedy]
        if random_seqs:
            self._sample(logits, metadata, random_seqs, accepted, ids)
        out = []
        for draft, start, count in zip(drafts, starts, accepted, strict=True):
            out.append(
                [SampledToken(token_id, None, None, None) for token_id in draft[:count]]
                + [SampledToken(ids[start + count], None, None, None)]
            )
        # The log-normalizer over the whole vocabulary is the sampler's dearest step: only for rows that ask.
        wanting = [i for i, count in enumerate(metadata.logprobs) if count is not None]
        if wanting:
            rows = [starts[i] + j for i in wanting for j in range(len(out[i]))]
            chosen = [token.token_id for i in wanting for token in out[i]]
            wanted = [metadata.logprobs[i] for i in wanting for _ in out[i]]
            with_logprobs = iter(
                self._logprobs(raw[rows].float(), torch.tensor(chosen, device=self.device), wanted)
            )
            for i in wanting:
                out[i] = [next(with_logprobs) for _ in out[i]]
        return out

    def score(self, logits: torch.Tensor, token_ids: list[int], wanted: list[int]) -> list[SampledToken]:
        """Each row's logprob and rank of token_ids[row] and its top wanted[row] logprobs, under the raw logits
        (prompt logprobs: nothing is sampled)."""
        return self._logprobs(logits.float(), torch.tensor(token_ids, device=self.device), wanted)

    def _logprobs(self, raw: torch.Tensor, token_ids: torch.Tensor, wanted: list[int]) -> list[SampledToken]:
        """Each row's chosen token's logprob and rank and its top `wanted` logprobs, under the raw logits."""
        log_norm = torch.logsumexp(raw, dim=-1)
        chosen_raw = raw.gather(1, token_ids[:, None])
        logprobs = (chosen_raw[:, 0] - log_norm).tolist()
        ranks = ((raw > chosen_raw).sum(dim=-1) + 1).tolist()
        k = min(max(wanted), raw.shape[1])
        top: list[list[tuple[int, float]]] = [[] for _ in wanted]
        if k:
            values, indices = raw.topk(k, dim=-1)
            values_list = (values - log_norm[:, None]).tolist()
            indices_list = indices.tolist()
            top = [
                list(zip(indices_list[i][:count], values_list[i][:count], strict=True))
                for i, count in enumerate(wanted)
            ]
        return [
            SampledToken(token_id, logprob, rank, row_top)
            for token_id, logprob, rank, row_top in zip(token_ids.tolist(), logprobs, ranks, top, strict=True)
        ]

    def _apply_grammar(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """-inf for the tokens each grammar row's matcher does not allow; other rows untouched. In place
        (the runner's logits are the step's own, read by nothing after the sampler) unless logprobs need the
        raw ones: a copy of the batch's logits each step costs more than masking them."""
        if metadata.grammar_rows is None:
            return logits
        if any(count is not None for count in metadata.logprobs):
            logits = logits.clone()
        apply_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows, self.native)
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.banned is None:
            return logits
        banned = logits.clone()
        banned[metadata.banned] = float("-inf")
        if metadata.grammar_rows is not None:
            # A grammar that allows only what min_tokens bans (its end) wins: the output must still parse,
            # and a row with no token left would sample garbage.
            rows = torch.tensor(metadata.grammar_rows, device=logits.device)
            dead = rows[torch.isneginf(banned[rows]).all(dim=-1)]
            if dead.numel():
                banned[dead] = logits[dead]
        return banned

    def _apply_penalties(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        repetition, additive = metadata.repetition, metadata.additive
        if repetition is None and additive is None:
            return logits
        logits = logits.clone()
        if repetition is not None:
            # Hugging Face semantics over prompt + output: divide positive logits, multiply negative ones.
            index = repetition.token_ids
            penalty = repetition.values["repetition_penalty"]
            sub = logits[repetition.rows]
            seen = sub.gather(1, index)
            sub.scatter_(1, index, torch.where(seen > 0, seen / penalty, seen * penalty))
            logits[repetition.rows] = sub
        if additive is not None:
            # OpenAI semantics over output tokens: subtract frequency * count + presence * (count > 0).
            index = additive.token_ids
            counts = torch.zeros(len(additive.rows), logits.shape[1], device=self.device)
            valid = torch.arange(index.shape[1], device=self.device)[None, :] < additive.lengths[:, None]
            counts.scatter_add_(1, index, valid.float())
            frequency = additive.values["frequency_penalty"]
            presence = additive.values["presence_penalty"]
            logits[additive.rows] -= frequency * counts + presence * (counts > 0).float()
        return logits

    def _sample(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        random_seqs: list[int],
        accepted: list[int],
        ids: list[int],
    ) -> None:
        """For the sequences with a temperature: set accepted[i] and ids[starts[i] + accepted[i]], the token
        drawn after the accepted drafts."""
        drafts, starts = metadata.drafts, metadata.starts
        rows, first = [], []
        for i in random_seqs:
            first.append(len(rows))
            rows += range(starts[i], starts[i] + 1 + len(drafts[i]))
        probs = self._probs(logits[rows] if len(rows) < logits.shape[0] else logits, metadata, rows)
        with_drafts = [k for k, i in enumerate(random_seqs) if drafts[i]]
        if with_drafts:
            draft_rows = [first[k] + j for k in with_drafts for j in range(len(drafts[random_seqs[k]]))]
            draft_ids = [token for k in with_drafts for token in drafts[random_seqs[k]]]
            draft_probs = iter(probs[draft_rows, draft_ids].tolist())
            for k in with_drafts:
                i = random_seqs[k]
                uniforms = self._uniforms(metadata.generators[i], len(drafts[i]))
                probs_i = [next(draft_probs) for _ in drafts[i]]
                count = 0
                while count < len(probs_i) and uniforms[count] < probs_i[count]:
                    count += 1
                accepted[i] = count
        final = probs[[first[k] + accepted[i] for k, i in enumerate(random_seqs)]]
        rejected = [
            (k, drafts[i][accepted[i]]) for k, i in enumerate(random_seqs) if accepted[i] < len(drafts[i])
        ]
        if rejected:
            # After a rejected draft token, draw from the residual max(p - q, 0) with q the one-token
            # proposal: p without the draft token (renormalizing is unnecessary for the race below).
            reject_rows, reject_ids = (list(column) for column in zip(*rejected, strict=True))
            final[reject_rows, reject_ids] = 0.0
        chosen = self._race(final, [metadata.generators[i] for i in random_seqs]).tolist()
        for k, i in enumerate(random_seqs):
            ids[starts[i] + accepted[i]] = chosen[k]

    def _uniforms(self, generator: torch.Generator | None, count: int) -> list[float]:
        generator = generator if generator is not None else self.generator
        return torch.rand(count, generator=generator, device=generator.device).tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, metadata: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        """Temperature, top-k, softmax, top-p, min-p: the distribution each of `rows` samples from (logits holds
        those rows, in order)."""
        logits = logits / metadata.temperature[rows]
        if metadata.top_k is not None:
            logits = _apply_top_k(logits, [metadata.top_k[row] for row in rows])
        probs = logits.softmax(dim=-1)
        if metadata.top_p is not None:
            probs = _apply_top_p(probs, metadata.top_p[rows])
        if metadata.min_p is not None:
            min_p = metadata.min_p[rows]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def _race(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One draw from each row of probs (unnormalized), with generators[row] (None: the sampler's own).

        Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (renormalization is unnecessary).
        Each seeded row draws its noise from its own generator, so its samples do not depend on the batch."""
        noise = torch.empty_like(probs)
        unseeded = []
        for row, generator in enumerate(generators):
            if generator is None:
                unseeded.append(row)
            else:
                noise[row] = torch.empty(probs.shape[1], device=generator.device).exponential_(
                    generator=generator
                )
        if unseeded:
            if len(unseeded) == len(generators):
                noise.exponential_(generator=self.generator)
            else:
                noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=self.device).exponential_(
                    generator=self.generator
                )
        # A zero draw means "arrives first"; keep it finite so a zero probability never wins by 0 / 0.
        return _argmax(probs / noise.clamp_(min=1e-30))


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
    reduction, faster on CPU (docs/benchmarks.md)."""
    return rows.max(dim=-1).indices


def _matching_prefix(draft: list[int], ids: list[int], start: int) -> int:
    """How many leading draft tokens equal ids[start:], the greedy choices after each of them."""
    count = 0
    for token in draft:
        if ids[start + count] != token:
            break
        count += 1
    return count
