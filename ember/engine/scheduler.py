"""Continuous-batching scheduler: what each engine step computes."""

from __future__ import annotations

from dataclasses import dataclass

from ember.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    # This step computes seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens].
    num_new_tokens: int
    # True when the chunk reaches the end of seq.token_ids: the runner samples one new token.
    sample: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # running decodes first, then prefill chunks; block tables cover the new tokens
    num_batched_tokens: int
