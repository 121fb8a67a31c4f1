"""What the sampler reads of one step's sampled sequences, gathered once per batch.

Sequence i owns 1 + len(drafts[i]) consecutive logits rows, from starts[i]: the logits after its last token,
then after each of its draft tokens. Per-row tensors repeat the sequence's value over its rows. Tensors a
batch does not need (no sampled rows, no penalties, no pending min_tokens) are None, so an all-greedy batch
without penalties builds none."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import Sequence


@dataclass
class Penalty:
    """One penalty's rows, the token ids each row has seen (padded), and the penalty values."""

    rows: list[int]
    token_ids: torch.Tensor  # [len(rows), longest], padded with the row's first id (or 0 when it has none)
    lengths: torch.Tensor | None  # [len(rows)] real lengths; None where padding repeats a seen id harmlessly
    values: dict[str, torch.Tensor]  # name -> [len(rows), 1]


@dataclass
class SamplingMetadata:
    # Per sequence.
    drafts: list[list[int]]
    starts: list[int]
    greedy: list[bool]
    logprobs: list[int | None]  # SamplingParams.logprobs: the top-k count, 0 = the sampled token only
    generators: list[torch.Generator | None]  # None: the sampler's own generator
    # Whether some row needs float32 logits: every token that is not a plain argmax, and logprobs.
    needs_float32: bool
    # Per row, only for the rows of sampled (temperature > 0) sequences; None when every sequence is greedy.
    temperature: torch.Tensor | None  # [R, 1]
    top_k: list[int] | None  # 0 = off
    top_p: torch.Tensor | None  # [R, 1]; inf where top_p is 1 (keep everything)
    min_p: torch.Tensor | None  # [R, 1]
    # min_tokens: (row, token id) pairs banned until enough outputs exist; None when none are.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    repetition: Penalty | None  # Hugging Face repetition_penalty over prompt + output
    additive: Penalty | None  # OpenAI presence/frequency penalties over the output
    # Structured output: the rows decoding under a grammar and the allowed-token bitmask over every row
    # ([R, ceil(V / 32)] int32, filled while the forward ran); None when no row has a grammar.
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], drafts: list[list[int]], eos_token_ids: Iterable[int],
                       device: torch.device,
                       grammar: tuple[list[int], torch.Tensor] | None = None) -> SamplingMetadata:
        """Gather once per batch; seqs[i] holds prompt + output so far, drafts[i] its draft tokens; grammar
        the rows decoding under a grammar and the bitmask the runner filled for them, if any."""
        starts, row_seqs = [], []
        for seq, draft in zip(seqs, drafts, strict=True):
            starts.append(len(row_seqs))
            row_seqs += [seq] * (1 + len(draft))
        params = [seq.params for seq in row_seqs]
        greedy = [seq.params.greedy for seq in seqs]
        sampled = [p for p in params if not p.greedy]
        return cls(
            drafts=drafts,
            starts=starts,
            greedy=greedy,
            logprobs=[seq.params.logprobs for seq in seqs],
            generators=[seq.generator for seq in seqs],
            needs_float32=not all(_argmax_only(seq) for seq in seqs),
            grammar_rows=grammar[0] if grammar is not None else None,
            grammar_bitmask=grammar[1] if grammar is not None else None,
            temperature=_column([p.temperature for p in params], device) if sampled else None,
            top_k=[p.top_k for p in params] if any(p.top_k for p in sampled) else None,
            # top_p == 1 keeps everything (a threshold of 1.0 could drop the tail to rounding in the cumsum).
            top_p=(_column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
                   if any(p.top_p < 1.0 for p in sampled) else None),
            min_p=_column([p.min_p for p in params], device) if any(p.min_p > 0.0 for p in sampled) else None,
            banned=_min_tokens_bans(row_seqs, list(eos_token_ids), device),
            repetition=_penalty(row_seqs, device, output_only=False, names=("repetition_penalty",),
                                applies=lambda p: p.repetition_penalty != 1.0),
            additive=_penalty(row_seqs, device, output_only=True, names=("frequency_penalty", "presence_penalty"),
                              applies=lambda p: p.presence_penalty != 0.0 or p.frequency_penalty != 0.0),
        )


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor([[value] for value in values], device=device)


def _min_tokens_bans(row_seqs: list[Sequence], eos_token_ids: list[int],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Until min_tokens outputs exist, EOS (unless ignore_eos, where it never stops anyway) and the stop
    token ids cannot be sampled."""
    rows, banned = [], []
    for row, seq in enumerate(row_seqs):
        params = seq.params
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            ids = list(params.stop_token_ids) + ([] if params.ignore_eos else eos_token_ids)
            rows += [row] * len(ids)
            banned += ids
    if not rows:
        return None
    return torch.tensor(rows, device=device), torch.tensor(banned, device=device)


def _penalty(row_seqs: list[Sequence], device: torch.device, output_only: bool, names: tuple[str, ...],
             applies: Callable[[SamplingParams], bool]) -> Penalty | None:
    rows = [row for row, seq in enumerate(row_seqs) if applies(seq.params)]
    if not rows:
        return None
    lists = [row_seqs[row].output_token_ids if output_only else row_seqs[row].token_ids for row in rows]
    width = max(1, max(len(ids) for ids in lists))
    padded = [ids + [ids[0] if ids else 0] * (width - len(ids)) for ids in lists]
    lengths = torch.tensor([len(ids) for ids in lists], device=device) if output_only else None
    return Penalty(
        rows=rows,
        token_ids=torch.tensor(padded, dtype=torch.long, device=device),
        lengths=lengths,
        values={name: _column([getattr(row_seqs[row].params, name) for row in rows], device) for name in names},
    )


def _argmax_only(seq: Sequence) -> bool:
    """Whether the sequence's next token is the argmax of the raw logits and nothing else is read of them
    (the argmax of bfloat16 logits is that of their exact float32 upcast)."""
    params = seq.params
    return (params.greedy and params.logprobs is None and not params.has_penalties
            and seq.num_output_tokens >= params.min_tokens)
