"""One sequence (one of a request's n completions) and its state machine.

WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (KV freed, recomputed later) -> RUNNING.
Any non-finished state -> FINISHED_ABORTED."""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING

import torch

from ember.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ember.engine.structured_output.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """Token ids (prompt + generated), KV progress and block table of one completion."""

    __slots__ = (
        "request_id", "seq_id", "index", "priority", "arrival_time", "token_ids", "num_prompt_tokens",
        "num_computed_tokens", "block_table", "params", "generator", "status", "draft_token_ids",
        # Scheduler bookkeeping below; the model runner reads only the fields above.
        "block_hashes", "num_committed_blocks", "num_cached_tokens", "num_forks", "max_tokens",
        "stop_reason", "num_preemptions", "grammar",
    )

    def __init__(
        self,
        request_id: str,
        seq_id: int,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float = 0.0,
        generator: torch.Generator | None = None,
        max_tokens: int | None = None,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.seq_id = seq_id
        self.index = index
        self.priority = priority
        self.arrival_time = arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.draft_token_ids: list[int] = []  # speculative tokens proposed to follow token_ids (decodes only)
        self.block_hashes: list[bytes] = []  # chained content hash of each full block of token_ids
        self.num_committed_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.num_forks = 0  # siblings to fork from this sequence once its prompt is computed (n > 1)
        # The engine passes params.max_tokens capped by the room left in max_model_len.
        self.max_tokens = max_tokens if max_tokens is not None else (params.max_tokens or sys.maxsize)
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        # Where the output stands in params.structured_output's grammar; None when unconstrained.
        self.grammar = grammar

    def fork(self, seq_id: int, index: int) -> Sequence:
        """Sibling `index` of this request: the same prompt and limits, no tokens computed yet."""
        generator = None
        if self.generator is not None:
            # Sibling i draws from seed + i: n seeded completions differ, and each is reproducible alone.
            generator = torch.Generator(device=self.generator.device).manual_seed(self.params.seed + index)
        # A sibling has no output yet: its matcher starts at the grammar's beginning.
        grammar = self.grammar.fresh() if self.grammar is not None else None
        return Sequence(self.request_id, seq_id, index, self.prompt_token_ids, self.params, self.priority,
                        self.arrival_time, generator, self.max_tokens, grammar)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(request_id={self.request_id!r}, index={self.index}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
