"""Scheduler policy: decodes before prefill chunks, token budget, priority/FCFS, preemption by recompute; and
update_from_output: accepted drafts, stop token ids, forks."""

from __future__ import annotations

import torch

from ember.engine.block_manager import BlockManager
from ember.engine.model_runner import ModelRunnerOutput
from ember.engine.sampler import SampledToken
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.engine.sequence import Sequence, SequenceStatus

BLOCK = 4


def make_seq(seq_id: int, num_prompt: int, priority: int = 0, arrival: float | None = None) -> Sequence:
    tokens = [1000 * seq_id + i for i in range(num_prompt)]
    return Sequence(f"r{seq_id}", seq_id, 0, tokens, SamplingParams(), priority=priority,
                    arrival_time=float(seq_id) if arrival is None else arrival)


def apply(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """The engine's part of a step: the KV of the scheduled tokens is computed, sampled rows get a token."""
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.block_manager.commit_full_blocks(item.seq)
        if item.sample:
            item.seq.token_ids.append(7)


def summary(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(item.seq.request_id, item.num_new_tokens, item.sample) for item in out.scheduled]


def check(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    scheduler.block_manager.check_invariants(seqs)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def test_decodes_first_then_chunked_prefill_within_the_budget():
    bm = BlockManager(num_blocks=64, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    a, b = make_seq(0, 5), make_seq(1, 12)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert summary(out) == [("r0", 5, True), ("r1", 3, False)]
    assert out.num_batched_tokens == 8
    apply(scheduler, out)
    # r0 decodes first; r1's prefill continues with what is left of the budget.
    out = scheduler.schedule()
    assert summary(out) == [("r0", 1, True), ("r1", 7, False)]
    apply(scheduler, out)
    c = make_seq(2, 20)
    scheduler.add(c)
    out = scheduler.schedule()
    assert summary(out) == [("r0", 1, True), ("r1", 2, True), ("r2", 5, False)]
    apply(scheduler, out)
    out = scheduler.schedule()
    assert summary(out) == [("r0", 1, True), ("r1", 1, True), ("r2", 6, False)]
    check(scheduler, [a, b, c])


def test_max_num_seqs_caps_the_batch():
    bm = BlockManager(num_blocks=64, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(i, 3) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [s for s, _, _ in summary(out)] == ["r0", "r1"]
    assert [seq.status for seq in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING] * 2
    apply(scheduler, out)
    scheduler.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = scheduler.schedule()
    assert summary(out) == [("r1", 1, True), ("r2", 3, True)]
    check(scheduler, seqs)


def test_token_budget_below_max_num_seqs_limits_the_batch_so_no_decode_starves():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=16, max_num_batched_tokens=4)
    assert scheduler.max_num_seqs == 4


def test_priority_then_fcfs_order_for_admission():
    bm = BlockManager(num_blocks=64, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    late_urgent = make_seq(0, 3, priority=-1, arrival=5.0)
    early_normal = make_seq(1, 3, priority=0, arrival=1.0)
    later_normal = make_seq(2, 3, priority=0, arrival=2.0)
    for seq in (later_normal, early_normal, late_urgent):
        scheduler.add(seq)
    admitted = []
    for _ in range(3):
        out = scheduler.schedule()
        admitted.append(out.scheduled[0].seq.request_id)
        apply(scheduler, out)
        scheduler.finish(out.scheduled[0].seq, SequenceStatus.FINISHED_LENGTH)
    assert admitted == ["r0", "r1", "r2"]
    check(scheduler, [])


def test_out_of_blocks_preempts_the_lowest_priority_newest_and_recomputes_it():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq(0, 4, priority=0), make_seq(1, 4, priority=1), make_seq(2, 4, priority=0)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [s for s, _, _ in summary(out)] == ["r0", "r2", "r1"]
    apply(scheduler, out)
    check(scheduler, seqs)
    # Every seq now needs a second block; only one is free. r0 gets it, then r2 needs one: the
    # lowest priority (r1, priority 1) is preempted even though r2 is newer.
    out = scheduler.schedule()
    assert summary(out) == [("r0", 1, True), ("r2", 1, True)]
    assert seqs[1].status is SequenceStatus.PREEMPTED and seqs[1].num_computed_tokens == 0
    assert seqs[1].block_table == [] and seqs[1].num_preemptions == 1
    assert scheduler.num_preemptions_total == 1
    assert scheduler.waiting == [seqs[1]]
    apply(scheduler, out)
    check(scheduler, seqs)
    scheduler.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    scheduler.finish(seqs[2], SequenceStatus.FINISHED_STOPPED)
    # The preempted seq recomputes its prompt and generated token in one chunk, then samples.
    out = scheduler.schedule()
    assert summary(out) == [("r1", 5, True)]
    check(scheduler, seqs)


def test_preempting_an_already_scheduled_seq_unschedules_it():
    bm = BlockManager(num_blocks=3, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    high, low = make_seq(0, 4, priority=0), make_seq(1, 3, priority=5)
    scheduler.add(low)
    apply(scheduler, scheduler.schedule())
    scheduler.add(high)
    apply(scheduler, scheduler.schedule())
    assert scheduler.running == [low, high] and bm.num_free_blocks == 1
    # low decodes first and takes the last free block; then high needs one, and low, the lowest
    # priority, is preempted although it is already in this step's batch: it is taken out again.
    out = scheduler.schedule()
    assert summary(out) == [("r0", 1, True)]
    assert out.num_batched_tokens == 1
    assert low.status is SequenceStatus.PREEMPTED and low.block_table == []
    check(scheduler, [high, low])


def test_finish_from_any_queue_frees_blocks_at_once():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    a, b, c = make_seq(0, 5), make_seq(1, 9), make_seq(2, 3)
    for seq in (a, b, c):
        scheduler.add(seq)
    apply(scheduler, scheduler.schedule())  # a whole, b partially; c waits
    scheduler.finish(b, SequenceStatus.FINISHED_ABORTED)
    scheduler.finish(c, SequenceStatus.FINISHED_ABORTED)
    assert b.block_table == [] and c not in scheduler.waiting and b not in scheduler.running
    check(scheduler, [a, b, c])
    scheduler.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 8 and not scheduler.running and not scheduler.waiting


class FixedDrafts:
    """A proposer that always drafts the same tokens."""

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft
        self.num_speculative_tokens = len(draft)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return self.draft[:max_tokens]


def sampled(*token_ids: int) -> list[SampledToken]:
    return [SampledToken(token_id, None, None, None) for token_id in token_ids]


def test_update_from_output_appends_accepted_drafts_and_stops_at_a_stop_token_id():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, eos_token_ids=[99],
                          proposer=FixedDrafts([8, 42, 9]))
    seq = Sequence("r0", scheduler.next_seq_id(), 0, [1, 2, 3, 4, 5], SamplingParams(stop_token_ids=[42]),
                   max_tokens=10)
    scheduler.add(seq)
    prefill = scheduler.schedule()
    assert summary(prefill) == [("r0", 5, True)]
    (update,) = scheduler.update_from_output(prefill, ModelRunnerOutput([sampled(7)], [None]))
    assert (update.chunk_start, [t.token_id for t in update.new_tokens]) == (0, [7])
    assert seq.token_ids == [1, 2, 3, 4, 5, 7] and seq.num_computed_tokens == 5
    assert seq.num_committed_blocks == 1  # the prompt's one full block is in the prefix cache

    decode = scheduler.schedule()
    assert [(item.num_new_tokens, item.draft_token_ids) for item in decode.scheduled] == [(4, [8, 42, 9])]
    # The sampler accepted all three drafts and drew 10; the stop token id 42 ends the sequence first.
    (update,) = scheduler.update_from_output(decode, ModelRunnerOutput([sampled(8, 42, 9, 10)], [None]))
    assert [t.token_id for t in update.new_tokens] == [8, 42]
    assert seq.token_ids == [1, 2, 3, 4, 5, 7, 8, 42]
    assert (seq.status, seq.stop_reason) == (SequenceStatus.FINISHED_STOPPED, 42)
    assert seq.num_computed_tokens == 7 and seq.block_table == [] and not scheduler.running
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 3)
    assert stats.accepted_per_position == [1, 1, 1]
    check(scheduler, [seq])


def test_update_from_output_forks_n_siblings_sharing_the_prompt_blocks():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    parent = Sequence("r0", scheduler.next_seq_id(), 0, list(range(10)), SamplingParams(n=3, seed=5),
                      generator=torch.Generator().manual_seed(5), max_tokens=4)
    parent.num_forks = 2
    scheduler.add(parent)
    out = scheduler.schedule()
    (update,) = scheduler.update_from_output(out, ModelRunnerOutput([sampled(11)], [None]))
    children = update.forked
    assert [(child.index, child.seq_id, child.status) for child in children] == [
        (1, 1, SequenceStatus.RUNNING), (2, 2, SequenceStatus.RUNNING)]
    # Each child shares the prompt's two full blocks and recomputes its last, partial block.
    assert all(child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
               for child in children)
    assert [bm.ref_counts[block] for block in parent.block_table] == [3, 3, 1]
    assert children[1].generator.initial_seed() == 7  # sibling i draws from seed + i
    assert scheduler.running == [parent, *children] and scheduler.num_reserved_seats == 0
    check(scheduler, [parent, *children])
    for seq in (parent, *children):
        scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
