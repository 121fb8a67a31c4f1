"""Continuous-batching scheduler: what each engine step computes, and the sequences' state after it."""

from __future__ import annotations

import dataclasses
import itertools
from bisect import insort
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.engine.block_manager import BlockManager
from ember.engine.ngram_proposer import NgramProposer
from ember.engine.outputs import SpecDecodeStats
from ember.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from ember.engine.model_runner import ModelRunnerOutput
    from ember.engine.sampler import SampledToken


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


@dataclass
class SequenceUpdate:
    """What one step did to one scheduled sequence, for the output processor."""

    seq: Sequence
    # seq.num_computed_tokens before the step: the chunk's prompt logprobs score the tokens after it.
    chunk_start: int
    # The scores of the prompt tokens this chunk computed (SamplingParams.prompt_logprobs), else None.
    prompt_logprobs: list[SampledToken] | None
    # The tokens appended to seq.token_ids, up to the one that finished it (if any).
    new_tokens: list[SampledToken] = dataclasses.field(default_factory=list)
    # Siblings forked from seq this step (n > 1): its prompt is computed.
    forked: list[Sequence] = dataclasses.field(default_factory=list)


class Scheduler:
    """Decides, each step, which tokens of which sequences the model computes.

    Running decodes come first (one token each, plus their draft tokens where they have some and
    budget and blocks allow), then running sequences still prefilling, then waiting sequences in
    priority order, each prefill chunked to fit the remaining token budget.
    When blocks run out, the lowest-priority newest running sequence is preempted: its blocks are
    freed and it goes back to waiting, to be recomputed later (its tokens are kept).

    After the step, update_from_output appends the sampled tokens and finishes sequences by length, EOS
    and stop token ids; stop strings are the output processor's (it finishes those through finish())."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Iterable[int] = (), proposer: NgramProposer | None = None) -> None:
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.proposer = proposer
        self.spec_stats = (SpecDecodeStats(accepted_per_position=[0] * proposer.num_speculative_tokens)
                           if proposer is not None else None)
        self._seq_ids = itertools.count()
        # Every running sequence gets at least one token per step, so none starves behind the others.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_reserved_seats = 0  # seats in the batch held for forks of running sequences (n > 1)
        self.num_preemptions_total = 0

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, seq: Sequence) -> None:
        if seq.num_forks + 1 > self.max_num_seqs:
            raise ValueError(f"n={seq.num_forks + 1} exceeds max_num_seqs={self.max_num_seqs}")
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=_sort_key)

    def finish(self, seq: Sequence, status: SequenceStatus, num_tokens: int | None = None) -> None:
        """Take `seq` out of the queues with a final status and free its blocks at once (also for a seq
        already finished: the status is overridden). `num_tokens` keeps only that many token ids: a stop
        string ended the sequence before the last tokens (accepted drafts) of this step."""
        if num_tokens is not None:
            del seq.token_ids[num_tokens:]
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
        if self.proposer is not None:
            self._propose_drafts()
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

    def _propose_drafts(self) -> None:
        """Give each running decode its draft tokens for this step (none where it cannot speculate)."""
        propose = self.proposer.propose
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens == 1 and _can_speculate(seq):
                # The last token the sequence may still emit is never a draft: it is sampled.
                seq.draft_token_ids = propose(seq.token_ids, seq.max_tokens - seq.num_output_tokens - 1)
            else:
                seq.draft_token_ids = []

    # ---- after the step ------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[SequenceUpdate]:
        """Apply what the step computed: computed tokens (accepted drafts included), full blocks committed to
        the prefix cache, forks of sequences whose prompt is done, sampled tokens appended, and sequences
        finished by length, EOS or a stop token id. One update per scheduled sequence, in order."""
        block_manager = self.block_manager
        updates = []
        for item, tokens, scores in zip(scheduler_output.scheduled, runner_output.sampled,
                                        runner_output.prompt_logprobs, strict=True):
            seq = item.seq
            update = SequenceUpdate(seq, seq.num_computed_tokens, scores)
            updates.append(update)
            num_drafts = len(item.draft_token_ids)
            seq.num_computed_tokens += item.num_new_tokens - num_drafts
            block_manager.commit_full_blocks(seq)
            if tokens is None:
                continue
            if seq.num_forks:
                update.forked = self._fork(seq)
            if num_drafts:
                self.spec_stats.record(num_drafts, len(tokens) - 1)
            for index, token in enumerate(tokens):
                if index:  # the token before was an accepted draft, whose K/V this step wrote
                    seq.num_computed_tokens += 1
                    block_manager.commit_full_blocks(seq)
                seq.token_ids.append(token.token_id)
                update.new_tokens.append(token)
                if seq.grammar is not None:
                    seq.grammar.accept(token.token_id)
                status = self._stop_status(seq, token.token_id)
                if status is not None:
                    self.finish(seq, status)
                    break
        return updates

    def _stop_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """The final status the token just appended gives `seq` (stop strings aside), or None."""
        params = seq.params
        num_output = seq.num_output_tokens
        if num_output >= seq.max_tokens:  # the engine caps max_tokens by the room left in max_model_len
            return SequenceStatus.FINISHED_LENGTH
        grammar_ended = seq.grammar is not None and seq.grammar.is_terminated and not params.ignore_eos
        if num_output < params.min_tokens and not grammar_ended:  # a finished grammar outranks min_tokens
            return None
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return SequenceStatus.FINISHED_STOPPED
        if token_id in params.stop_token_set:
            seq.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        return None

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The parent's prompt is computed: create its siblings sharing the prompt's full blocks.

        Each sibling recomputes only the prompt's last, partial block (at least one token, so it can sample
        its own first token) into a block of its own."""
        block_size = self.block_manager.block_size
        num_shared = (parent.num_prompt_tokens - 1) // block_size
        children = []
        for index in range(1, parent.num_forks + 1):
            child = parent.fork(self.next_seq_id(), index)
            self.block_manager.fork(parent, child, num_shared)
            child.num_computed_tokens = num_shared * block_size
            child.num_cached_tokens = parent.num_cached_tokens
            children.append(child)
        self.num_reserved_seats -= len(children)
        parent.num_forks = 0
        for child in children:
            child.status = SequenceStatus.RUNNING
        self.running.extend(children)
        return children


def _sort_key(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_time, seq.seq_id)


def _can_speculate(seq: Sequence) -> bool:
    """Drafted rows are sampled without the tokens before them: no penalties and no pending min_tokens. A
    grammar is fine: the runner masks each draft row under the grammar advanced through the drafts before it."""
    return not seq.params.has_penalties and seq.num_output_tokens >= seq.params.min_tokens
