"""Continuous-batching scheduler: what each engine step computes."""

from __future__ import annotations

import dataclasses
from bisect import insort
from dataclasses import dataclass

from ember.engine.block_manager import BlockManager
from ember.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    # This step computes seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens].
    num_new_tokens: int
    # True when the chunk reaches the end of seq.token_ids: the runner samples one new token.
    sample: bool
    # Speculative tokens computed after the decode's one token (num_new_tokens counts them); the sampler
    # verifies them and keeps the longest accepted run plus one token of its own.
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # running decodes first, then prefill chunks; block tables cover the new tokens
    num_batched_tokens: int


class Scheduler:
    """Decides, each step, which tokens of which sequences the model computes.

    Running decodes come first (one token each, plus their draft tokens where they have some and
    budget and blocks allow), then running sequences still prefilling, then waiting sequences in
    priority order, each prefill chunked to fit the remaining token budget.
    When blocks run out, the lowest-priority newest running sequence is preempted: its blocks are
    freed and it goes back to waiting, to be recomputed later (its tokens are kept)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        # Every running sequence gets at least one token per step, so none starves behind the others.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_reserved_seats = 0  # seats in the batch held for forks of running sequences (n > 1)
        self.num_preemptions_total = 0

    def add(self, seq: Sequence) -> None:
        if seq.num_forks + 1 > self.max_num_seqs:
            raise ValueError(f"n={seq.num_forks + 1} exceeds max_num_seqs={self.max_num_seqs}")
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=_sort_key)

    def add_forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Seat the children forked from a running parent (they prefill their last partial block)."""
        self.num_reserved_seats -= len(children)
        parent.num_forks = 0
        for child in children:
            child.status = SequenceStatus.RUNNING
        self.running.extend(children)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take `seq` out of the queues with a final status and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self._remove_running(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)

    def _remove_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.num_reserved_seats -= seq.num_forks

    def _preempt(self, seq: Sequence) -> None:
        self._remove_running(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        seq.status = SequenceStatus.PREEMPTED
        insort(self.waiting, seq, key=_sort_key)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        block_manager = self.block_manager
        scheduled: list[ScheduledSeq] = []
        preempted = False
        running = SequenceStatus.RUNNING
        for decodes in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                remaining = seq.num_tokens - seq.num_computed_tokens
                if seq.status is not running or (remaining == 1) is not decodes:
                    continue
                num_new = min(remaining, budget)
                if decodes and seq.draft_token_ids:
                    draft = seq.draft_token_ids[: budget - 1]
                    # Drafts are a gamble: they take blocks only while one free block per running sequence
                    # is left for its own next token; otherwise they are dropped, never preempting for them.
                    needed = block_manager.blocks_needed(seq.num_computed_tokens + 1 + len(draft))
                    spare = block_manager.num_free_blocks - max(needed - len(seq.block_table), 0)
                    if draft and spare >= len(self.running) and block_manager.allocate(seq, 1 + len(draft)):
                        scheduled.append(ScheduledSeq(seq, 1 + len(draft), True, draft))
                        budget -= 1 + len(draft)
                        continue
                while not block_manager.allocate(seq, num_new):
                    victim = max(self.running, key=_sort_key)
                    self._preempt(victim)
                    preempted = True
                    for i, item in enumerate(scheduled):
                        if item.seq is victim:
                            budget += scheduled.pop(i).num_new_tokens
                            break
                    if victim is seq:
                        break
                else:
                    scheduled.append(ScheduledSeq(seq, num_new, num_new == remaining))
                    budget -= num_new

        # Admitting new work right after a preemption would only thrash the cache.
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if len(self.running) + self.num_reserved_seats + 1 + seq.num_forks > self.max_num_seqs:
                break
            # Prompt logprobs need every prompt position's logits: no prefix-cache hits for them.
            cached_blocks = block_manager.get_computed_blocks(seq) if seq.params.prompt_logprobs is None else []
            num_cached = len(cached_blocks) * block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not block_manager.allocate(seq, num_new, cached_blocks):
                break
            block_manager.record_prefix_lookup(seq.num_tokens, num_cached)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            del self.waiting[0]
            seq.status = running
            self.running.append(seq)
            self.num_reserved_seats += seq.num_forks
            scheduled.append(ScheduledSeq(seq, num_new, num_cached + num_new == seq.num_tokens))
            budget -= num_new
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget)


def _sort_key(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_time, seq.seq_id)
