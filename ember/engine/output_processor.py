"""What clients see of each request: detokenized text, stop strings, logprobs with their token text, and the
RequestOutputs built from them, plus the request-level counters behind EngineStats.

The scheduler owns the sequences (token ids, KV blocks, finishing by length, EOS and stop token ids); this
module reads its SequenceUpdates after each step and finishes, through Scheduler.finish, the sequences a stop
string ends."""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING

from ember.engine.detokenizer import IncrementalDetokenizer, decode_token
from ember.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ember.engine.sampler import SampledToken
from ember.engine.scheduler import Scheduler, SequenceUpdate
from ember.engine.sequence import Sequence, SequenceStatus
from ember.loader.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ember.engine.llm_engine import PreparedRequest


class CompletionState:
    """One completion's text and logprobs, and how much of them was already streamed."""

    __slots__ = ("detokenizer", "logprobs", "cumulative_logprob", "sent_tokens", "sent_text", "sent_logprobs")

    def __init__(self, detokenizer: IncrementalDetokenizer, wants_logprobs: bool) -> None:
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants_logprobs else None
        self.cumulative_logprob = 0.0
        self.sent_tokens = 0  # for output_kind "delta"
        self.sent_text = 0
        self.sent_logprobs = 0


class RequestState:
    """One request's n sequences (the scheduler's) and their completions (ours)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "seqs", "completions", "metrics",
                 "num_unfinished", "error", "prompt_logprobs", "sent_prompt_logprobs")

    def __init__(self, prepared: PreparedRequest) -> None:
        params = prepared.params
        self.request_id = prepared.request_id
        self.prompt = prepared.prompt
        self.prompt_token_ids = prepared.prompt_token_ids
        self.params = params
        self.seqs: list[Sequence | None] = [None] * params.n  # siblings appear when the prompt is computed
        self.completions: list[CompletionState | None] = [None] * params.n
        self.metrics = RequestMetrics(arrival_time=prepared.arrival_time)
        self.num_unfinished = params.n
        self.error: str | None = None
        # With params.prompt_logprobs: one entry per prompt token scored so far; the first has none.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.sent_prompt_logprobs = False  # for output_kind "delta": sent once, when complete

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.requests: dict[str, RequestState] = {}
        self._token_text_cache: dict[int, str] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_by_reason = {"stop": 0, "length": 0, "abort": 0}

    def add_request(self, prepared: PreparedRequest, seq: Sequence) -> None:
        request = RequestState(prepared)
        self._add_sequence(request, seq)
        self.requests[prepared.request_id] = request

    def _add_sequence(self, request: RequestState, seq: Sequence) -> None:
        params = request.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        request.seqs[seq.index] = seq
        request.completions[seq.index] = CompletionState(detokenizer, params.logprobs is not None)

    # ---- after each step ----------------------------------------------------------------------

    def process_outputs(self, updates: list[SequenceUpdate]) -> list[RequestOutput]:
        """Take in one step's updates; return the outputs of every request that produced a token or finished
        (with output_kind "final", only the finished ones)."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        requests = self.requests
        for update in updates:
            seq = update.seq
            request = requests[seq.request_id]
            scores = update.prompt_logprobs
            # A prompt is scored once, in order: not again by a recomputation after preemption, nor by the
            # partial last block each forked sibling recomputes.
            if scores is not None and len(request.prompt_logprobs) == update.chunk_start + 1:
                request.prompt_logprobs += [self._logprob_entry(score) for score in scores]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            for child in update.forked:
                self._add_sequence(request, child)
            if not update.new_tokens:
                continue
            self._process_tokens(request, seq, update.new_tokens, now)
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.finished:
                self._retire(request)
            if request.finished or request.params.output_kind != "final":
                outputs.append(self._make_output(request))
        return outputs

    def _process_tokens(self, request: RequestState, seq: Sequence, tokens: list[SampledToken],
                        now: float) -> None:
        """Logprobs, metrics and text of the tokens the scheduler appended to `seq` this step; a stop string
        in the text finishes the sequence at the token that completed it."""
        completion = request.completions[seq.index]
        params = request.params
        metrics = request.metrics
        num_tokens_before = seq.num_tokens - len(tokens)
        for index, token in enumerate(tokens):
            if completion.logprobs is not None:
                completion.cumulative_logprob += token.logprob
                completion.logprobs.append(self._logprob_entry(token))
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self.prompt_tokens_total += len(request.prompt_token_ids)
            metrics.last_token_time = now
            metrics.num_generation_tokens += 1
            self.generation_tokens_total += 1
            is_last = index == len(tokens) - 1
            # A stop token (EOS or a stop token id) adds no text unless include_stop_str_in_output.
            stopped_by_token = is_last and seq.status is SequenceStatus.FINISHED_STOPPED
            show = not stopped_by_token or params.include_stop_str_in_output
            stop_string = completion.detokenizer.update(token.token_id, decode=show)
            if stop_string is not None:
                seq.stop_reason = stop_string
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, num_tokens_before + index + 1)
                break
        if seq.is_finished:
            self._finish(request, seq)

    def _logprob_entry(self, token: SampledToken) -> dict[int, Logprob]:
        cache = self._token_text_cache
        tokenizer = self.tokenizer
        entry = {token.token_id: Logprob(token.logprob, token.rank, decode_token(tokenizer, token.token_id, cache))}
        for rank, (token_id, logprob) in enumerate(token.top_logprobs or (), start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(logprob, rank, decode_token(tokenizer, token_id, cache))
        return entry

    # ---- finishing ----------------------------------------------------------------------------

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Finish the request's sequences with reason "abort" (freeing their blocks) and return its final
        output; None for an unknown id."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.error = error
        for seq in request.seqs:
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._finish(request, seq)
        # Siblings never forked count as aborted too.
        self.finished_by_reason["abort"] += request.num_unfinished
        request.num_unfinished = 0
        self._retire(request)
        return self._make_output(request)

    def _finish(self, request: RequestState, seq: Sequence) -> None:
        """The request-level bookkeeping of a sequence the scheduler has finished."""
        request.completions[seq.index].detokenizer.finish()
        request.metrics.num_preemptions += seq.num_preemptions
        request.num_unfinished -= 1
        self.finished_by_reason[seq.status.finish_reason] += 1

    def _retire(self, request: RequestState) -> None:
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)

    # ---- outputs ------------------------------------------------------------------------------

    def _make_output(self, request: RequestState) -> RequestOutput:
        delta = request.params.output_kind == "delta"
        outputs = []
        for index, (seq, completion) in enumerate(zip(request.seqs, request.completions, strict=True)):
            if seq is None:  # a sibling that was never forked: the request ended before its prompt did
                outputs.append(CompletionOutput(index, "", [], None if request.params.logprobs is None
                                                else 0.0, None, "abort"))
                continue
            text = completion.detokenizer.visible_text()
            token_ids = seq.output_token_ids
            logprobs = completion.logprobs
            if delta:
                text, completion.sent_text = text[completion.sent_text:], len(text)
                token_ids, completion.sent_tokens = token_ids[completion.sent_tokens:], len(token_ids)
                if logprobs is not None:
                    logprobs, completion.sent_logprobs = logprobs[completion.sent_logprobs:], len(logprobs)
            elif logprobs is not None:
                logprobs = list(logprobs)
            outputs.append(CompletionOutput(
                index=index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=completion.cumulative_logprob if completion.logprobs is not None else None,
                logprobs=logprobs,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is not None:
            if len(prompt_logprobs) < len(request.prompt_token_ids) or (delta and request.sent_prompt_logprobs):
                prompt_logprobs = None
            else:
                request.sent_prompt_logprobs = True
                prompt_logprobs = list(prompt_logprobs)
        parent = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=parent.num_cached_tokens if parent is not None else 0,
            metrics=copy.copy(request.metrics),
            error=request.error,
            prompt_logprobs=prompt_logprobs,
        )
