"""The synchronous engine: requests in, one batched model step at a time, RequestOutputs out.

Nothing here is thread-safe; AsyncEngine drives one LLMEngine from a single thread."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ember.engine.args import EngineArgs
from ember.engine.block_manager import BlockManager
from ember.engine.detokenizer import IncrementalDetokenizer, decode_token
from ember.engine.errors import EmptyPromptError, InvalidRequestError, InvalidTokenIdError, PromptTooLongError
from ember.engine.model_runner import ModelRunner
from ember.engine.ngram_proposer import NgramProposer
from ember.engine.outputs import (
    CompletionOutput,
    EngineStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SpecDecodeStats,
)
from ember.engine.sampler import SampledToken
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.engine.sequence import Sequence, SequenceStatus
from ember.errors import EmberError
from ember.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN_CAP = 8192


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class PreparedRequest:
    """A tokenized, validated request, ready for add_prepared_request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


class _Request:
    """One request's n sequences and what has already been streamed of each."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "seqs", "metrics", "num_unfinished",
                 "sent_tokens", "sent_text", "sent_logprobs", "error", "prompt_logprobs", "sent_prompt_logprobs")

    def __init__(self, prepared: PreparedRequest) -> None:
        params = prepared.params
        self.request_id = prepared.request_id
        self.prompt = prepared.prompt
        self.prompt_token_ids = prepared.prompt_token_ids
        self.params = params
        self.seqs: list[Sequence | None] = [None] * params.n  # siblings appear when the prompt is computed
        self.metrics = RequestMetrics(arrival_time=prepared.arrival_time)
        self.num_unfinished = params.n
        self.sent_tokens = [0] * params.n  # for output_kind "delta"
        self.sent_text = [0] * params.n
        self.sent_logprobs = [0] * params.n
        self.error: str | None = None
        # With params.prompt_logprobs: one entry per prompt token scored so far; the first has none.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.sent_prompt_logprobs = False  # for output_kind "delta": sent once, when complete

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        device = resolve_device(args.device)
        if loaded is None:
            loaded = load_model(args.model, dtype=args.dtype, device=device)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.runner = ModelRunner(loaded.config, loaded.state_dict, dataclasses.replace(args, device=str(device)))
        loaded.state_dict.clear()  # the runner holds the weights now; drop the loader's references
        self.max_model_len = self._resolve_max_model_len()
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._next_seq_id = 0
        self._token_text_cache: dict[int, str] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        spec = args.speculative_config
        self.proposer = None
        self.spec_stats = None
        if spec is not None:
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max)
            self.spec_stats = SpecDecodeStats(accepted_per_position=[0] * spec.num_speculative_tokens)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        kv_capacity = self.runner.num_blocks * self.runner.block_size
        if self.args.max_model_len is None:
            return min(model_max, DEFAULT_MAX_MODEL_LEN_CAP, kv_capacity)
        if self.args.max_model_len > model_max:
            raise EmberError(f"max_model_len {self.args.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({model_max})")
        if self.args.max_model_len > kv_capacity:
            raise EmberError(f"max_model_len {self.args.max_model_len} does not fit the KV cache "
                             f"({kv_capacity} tokens): raise kv_cache_memory or lower max_model_len")
        return self.args.max_model_len

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (a ValueError) for a duplicate id, an empty or too long
        prompt, token ids outside the vocabulary, or n above max_num_seqs."""
        self.add_prepared_request(self.prepare_request(request_id, prompt, params, priority, arrival_time))

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        priority: int = 0, arrival_time: float | None = None) -> PreparedRequest:
        """Tokenize and validate a request without touching engine state (safe from any thread)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text = None
            prompt_token_ids = list(prompt)
        self.check_prompt(prompt_token_ids)
        if params.n > self.scheduler.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.scheduler.max_num_seqs}",
                                      param="n")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        return PreparedRequest(request_id, prompt_text, prompt_token_ids, params, priority, arrival_time)

    def check_prompt(self, prompt_token_ids: list[int], param: str = "prompt") -> None:
        """Raise InvalidRequestError unless the prompt is non-empty, in the vocabulary and leaves room for
        output; `param` names the caller's field holding the prompt."""
        self.check_token_ids(prompt_token_ids, param)
        if not prompt_token_ids:
            raise EmptyPromptError("The prompt is empty (it encodes to zero tokens)", param)
        num_prompt, limit = len(prompt_token_ids), self.max_model_len
        if num_prompt >= limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt} tokens, which leaves no room for the completion. Please shorten the prompt.",
                param)

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        """Raise InvalidTokenIdError naming a negative or non-integer id, else the largest id past the
        vocabulary, if there is one."""
        vocab_size = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or t < 0), None)
        if bad is None and token_ids and max(token_ids) >= vocab_size:
            bad = max(token_ids)
        if bad is not None:
            raise InvalidTokenIdError(f"Token id {bad!r} is out of range (vocabulary size {vocab_size})",
                                      param)

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        if prepared.request_id in self.requests:
            raise InvalidRequestError(f"request_id {prepared.request_id!r} is already in use")
        request = _Request(prepared)
        seq = self._new_sequence(request, 0, prepared.prompt_token_ids, prepared.priority)
        seq.num_forks = prepared.params.n - 1
        self.scheduler.add(seq)
        self.requests[prepared.request_id] = request

    def _new_sequence(self, request: _Request, index: int, prompt_token_ids: list[int],
                      priority: int) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            # Sibling i draws from seed + i: n seeded completions differ, and each is reproducible alone.
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + index)
        room = self.max_model_len - len(prompt_token_ids)
        seq = Sequence(request.request_id, self._next_seq_id, index, prompt_token_ids, params,
                       priority=priority, arrival_time=request.metrics.arrival_time, generator=generator,
                       max_tokens=min(params.max_tokens or room, room))
        self._next_seq_id += 1
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        request.seqs[index] = seq
        return seq

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish the requests with reason "abort" and free their blocks now; unknown ids are ignored.
        Returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._abort(request)
                outputs.append(self._make_output(request, final=True))
        return outputs

    def _abort(self, request: _Request, error: str | None = None) -> None:
        request.error = error
        for seq in request.seqs:
            if seq is not None and not seq.is_finished:
                self._finish(request, seq, SequenceStatus.FINISHED_ABORTED)
        # Siblings never forked count as aborted too.
        self._finished_by_reason["abort"] += request.num_unfinished
        request.num_unfinished = 0
        self._retire(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward + sampling, and return the outputs of every request that
        produced a token or finished in this step."""
        if self.proposer is not None:
            self._propose_drafts()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return []
        try:
            result = self.runner.execute(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - fail the batch's requests, keep the engine alive
            return self._fail_batch(scheduler_output, exc)
        now = time.monotonic()
        block_manager = self.block_manager
        touched: dict[str, _Request] = {}
        requests = self.requests
        for item, tokens, scores in zip(scheduler_output.scheduled, result.sampled, result.prompt_logprobs,
                                        strict=True):
            seq = item.seq
            request = requests[seq.request_id]
            # A prompt is scored once, in order: not again by a recomputation after preemption, nor by the
            # partial last block each forked sibling recomputes.
            if scores is not None and len(request.prompt_logprobs) == seq.num_computed_tokens + 1:
                request.prompt_logprobs += [self._logprob_entry(score) for score in scores]
            num_drafts = len(item.draft_token_ids)
            seq.num_computed_tokens += item.num_new_tokens - num_drafts
            block_manager.commit_full_blocks(seq)
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if tokens is None:
                continue
            if seq.num_forks:
                self._fork(request, seq)
            if num_drafts:
                self.spec_stats.record(num_drafts, len(tokens) - 1)
            for index, token in enumerate(tokens):
                if index:  # the token before was an accepted draft, whose K/V this step wrote
                    seq.num_computed_tokens += 1
                    block_manager.commit_full_blocks(seq)
                self._append_token(request, seq, token, now)
                if seq.is_finished:
                    break
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.finished:
                self._retire(request)
            if request.finished or request.params.output_kind != "final":
                outputs.append(self._make_output(request))
        return outputs

    def _propose_drafts(self) -> None:
        """Give each running decode its draft tokens for this step (none where it cannot speculate)."""
        propose = self.proposer.propose
        for seq in self.scheduler.running:
            if seq.num_tokens - seq.num_computed_tokens == 1 and _can_speculate(seq):
                # The last token the sequence may still emit is never a draft: it is sampled.
                seq.draft_token_ids = propose(seq.token_ids, seq.max_tokens - seq.num_output_tokens - 1)
            else:
                seq.draft_token_ids = []

    def _fail_batch(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        logger.exception("engine step failed; failing the %d scheduled sequences' requests",
                         len(scheduler_output.scheduled))
        error = f"engine step failed: {type(exc).__name__}: {exc}"
        failed = {item.seq.request_id: self.requests[item.seq.request_id] for item in scheduler_output.scheduled}
        for request in failed.values():
            self._abort(request, error)
        return [self._make_output(request, final=True) for request in failed.values()]

    def _fork(self, request: _Request, parent: Sequence) -> None:
        """The parent's prompt is computed: create its n-1 siblings sharing the prompt's full blocks.

        Each sibling recomputes only the prompt's last, partial block (at least one token, so it can sample
        its own first token) into a block of its own."""
        num_shared = (parent.num_prompt_tokens - 1) // self.block_manager.block_size
        children = []
        for index in range(1, request.params.n):
            child = self._new_sequence(request, index, request.prompt_token_ids, parent.priority)
            self.block_manager.fork(parent, child, num_shared)
            child.num_computed_tokens = num_shared * self.block_manager.block_size
            child.num_cached_tokens = parent.num_cached_tokens
            children.append(child)
        self.scheduler.add_forked(parent, children)

    def _append_token(self, request: _Request, seq: Sequence, token: SampledToken, now: float) -> None:
        token_id = token.token_id
        seq.token_ids.append(token_id)
        if seq.logprobs is not None:
            seq.cumulative_logprob += token.logprob
            seq.logprobs.append(self._logprob_entry(token))
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self._prompt_tokens_total += len(request.prompt_token_ids)
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1
        self._generation_tokens_total += 1

        params = seq.params
        status = None
        num_output = seq.num_tokens - seq.num_prompt_tokens
        if num_output >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        elif num_output >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                status = SequenceStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_set:
                status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token_id
        show = status is not SequenceStatus.FINISHED_STOPPED or params.include_stop_str_in_output
        stop_string = seq.detokenizer.update(token_id, decode=show)
        if stop_string is not None:
            status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop_string
        if status is not None:
            self._finish(request, seq, status)

    def _logprob_entry(self, token: SampledToken) -> dict[int, Logprob]:
        cache = self._token_text_cache
        tokenizer = self.tokenizer
        entry = {token.token_id: Logprob(token.logprob, token.rank, decode_token(tokenizer, token.token_id, cache))}
        for rank, (token_id, logprob) in enumerate(token.top_logprobs or (), start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(logprob, rank, decode_token(tokenizer, token_id, cache))
        return entry

    def _finish(self, request: _Request, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        seq.detokenizer.finish()
        request.metrics.num_preemptions += seq.num_preemptions
        request.num_unfinished -= 1
        self._finished_by_reason[status.finish_reason] += 1

    def _retire(self, request: _Request) -> None:
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)

    # ---- outputs ------------------------------------------------------------------------------

    def _make_output(self, request: _Request, final: bool = False) -> RequestOutput:
        delta = request.params.output_kind == "delta"
        completions = []
        for index, seq in enumerate(request.seqs):
            if seq is None:  # a sibling that was never forked: the request ended before its prompt did
                completions.append(CompletionOutput(index, "", [], None if request.params.logprobs is None
                                                    else 0.0, None, "abort"))
                continue
            text = seq.detokenizer.visible_text()
            token_ids = seq.token_ids[seq.num_prompt_tokens:]
            logprobs = seq.logprobs
            if delta:
                text, request.sent_text[index] = text[request.sent_text[index]:], len(text)
                token_ids, request.sent_tokens[index] = token_ids[request.sent_tokens[index]:], len(token_ids)
                if logprobs is not None:
                    logprobs, request.sent_logprobs[index] = (logprobs[request.sent_logprobs[index]:],
                                                              len(logprobs))
            elif logprobs is not None:
                logprobs = list(logprobs)
            completions.append(CompletionOutput(
                index=index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
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
            outputs=completions,
            finished=request.finished or final,
            num_cached_tokens=parent.num_cached_tokens if parent is not None else 0,
            metrics=copy.copy(request.metrics),
            error=request.error,
            prompt_logprobs=prompt_logprobs,
        )

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        block_manager = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted_total=self.scheduler.num_preemptions_total,
            kv_cache_usage=block_manager.usage,
            num_total_blocks=block_manager.num_blocks,
            num_free_blocks=block_manager.num_free_blocks,
            prefix_cache_queries=block_manager.prefix_cache_queries,
            prefix_cache_hits=block_manager.prefix_cache_hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_requests_finished=dict(self._finished_by_reason),
            spec_decode=self.spec_stats.copy() if self.spec_stats is not None else None,
        )

    def live_sequences(self) -> list[Sequence]:
        return [seq for request in self.requests.values() for seq in request.seqs if seq is not None]

    def check_invariants(self) -> None:
        """Assert the KV-block accounting is exact (tests call this after every step)."""
        self.block_manager.check_invariants(self.live_sequences())
        for seq in self.scheduler.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq!r} in the running queue"
        for seq in self.scheduler.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), f"{seq!r} waiting"
            assert not seq.block_table, f"waiting {seq!r} holds blocks"
        if not self.requests:
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "blocks leaked"


def _can_speculate(seq: Sequence) -> bool:
    """Drafted rows are sampled without the tokens before them: no penalties, no pending min_tokens."""
    return not seq.params.has_penalties and seq.num_output_tokens >= seq.params.min_tokens
