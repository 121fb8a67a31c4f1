"""The synchronous engine: requests in, one batched model step at a time, RequestOutputs out.

Nothing here is thread-safe; AsyncEngine drives one LLMEngine from a single thread."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ember.engine.args import EngineArgs
from ember.engine.block_manager import BlockManager
from ember.engine.errors import EmptyPromptError, InvalidRequestError, InvalidTokenIdError, PromptTooLongError
from ember.engine.model_runner import ModelRunner
from ember.engine.ngram_proposer import NgramProposer
from ember.engine.output_processor import OutputProcessor, RequestState
from ember.engine.outputs import EngineStats, RequestOutput
from ember.engine.parallel import TensorParallelError, check_tensor_parallel
from ember.engine.resources import resolve_device, resolve_max_model_len
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.engine.sequence import Sequence, SequenceStatus
from ember.engine.structured_output.grammar import GrammarMatcher, StructuredOutputManager
from ember.engine.tp_worker import TensorParallelWorkers
from ember.loader import load_model

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PreparedRequest:
    """A tokenized, validated request, ready for add_prepared_request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    grammar: GrammarMatcher | None  # params.structured_output's grammar, compiled


def freeze_startup_objects() -> None:
    """For a process that runs one engine for its life (`ember serve`, `ember bench offline`), once it is
    built: what loading left (modules, the tokenizer, torch's and the libraries' objects) stays, so the
    collector's full collections during steps need not scan it (they took 1.7% of a c=32 offline run's
    samples, as vLLM found and freezes the same way). Not in LLMEngine itself: a process that builds engines
    and drops them (the tests) would never collect a frozen one's cycles."""
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        device = resolve_device(args.device)
        self.args = args = replace(args, quantization=args.quantization_for(device.type))
        loaded = load_model(args.model, dtype=args.dtype, device=device, quantization=args.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.workers: TensorParallelWorkers | None = None
        if args.tensor_parallel_size > 1:
            check_tensor_parallel(loaded.config, args.tensor_parallel_size)
            self.workers = TensorParallelWorkers(args, loaded.config)
        try:
            self.runner = ModelRunner(loaded.config, loaded.state_dict, args,
                                      None if self.workers is None else self.workers.group)
            if self.workers is not None:
                self._run_collective(self.workers.wait_until_loaded)
        except BaseException:
            if self.workers is not None:
                self.workers.stop()
            raise
        self.max_model_len = resolve_max_model_len(self.model_config, args.max_model_len,
                                                   self.runner.num_blocks * self.runner.block_size)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          args.enable_prefix_caching)
        spec = args.speculative_config
        proposer = None if spec is None else NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                           spec.prompt_lookup_max)
        eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   eos_token_ids, proposer)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         sorted(eos_token_ids))

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (a ValueError) for a duplicate id, an empty or too long
        prompt, token ids outside the vocabulary, or n above max_num_seqs."""
        self.add_prepared_request(self.prepare_request(request_id, prompt, params, priority, arrival_time))

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        priority: int = 0, arrival_time: float | None = None) -> PreparedRequest:
        """Tokenize and validate a request, and compile its grammar, without touching engine state (safe from
        any thread)."""
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
        grammar = (self.structured_output.matcher_for(params.structured_output)
                   if params.structured_output is not None else None)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        return PreparedRequest(request_id, prompt_text, prompt_token_ids, params, priority, arrival_time, grammar)

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
        params = prepared.params
        generator = None
        if params.seed is not None:
            # Sibling i draws from seed + i (Sequence.fork): this is sibling 0.
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        room = self.max_model_len - len(prepared.prompt_token_ids)
        seq = Sequence(prepared.request_id, self.scheduler.next_seq_id(), 0, prepared.prompt_token_ids, params,
                       priority=prepared.priority, arrival_time=prepared.arrival_time, generator=generator,
                       max_tokens=min(params.max_tokens or room, room), grammar=prepared.grammar)
        seq.num_forks = params.n - 1
        self.scheduler.add(seq)
        self.output_processor.add_request(prepared, seq)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish the requests with reason "abort" and free their blocks now; unknown ids are ignored.
        Returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = (self.output_processor.abort(request_id) for request_id in request_ids)
        return [output for output in outputs if output is not None]

    @property
    def requests(self) -> dict[str, RequestState]:
        """The unfinished requests by id."""
        return self.output_processor.requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward + sampling, update the sequences, and return the outputs of
        every request that produced a token or finished in this step."""
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return []
        try:
            runner_output = self._run_collective(self.runner.execute, scheduler_output)
        except TensorParallelError:
            raise  # a rank is gone: no later step can run either
        except Exception as exc:  # noqa: BLE001 - fail the batch's requests, keep the engine alive
            return self._fail_batch(scheduler_output, exc)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self.output_processor.process_outputs(updates)

    def _run_collective(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)`, where a failed tensor-parallel collective raises TensorParallelError naming the
        dead worker."""
        if self.workers is not None and self.workers.failure is not None:
            raise TensorParallelError(f"tensor-parallel worker died: {self.workers.failure}")
        try:
            return function(*args)
        except TensorParallelError as exc:
            raise self.workers.check_alive(exc) from exc

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run another step (a tensor-parallel worker died), else None."""
        return None if self.workers is None else self.workers.failure

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank); the engine takes no step after."""
        if self.workers is not None and self.workers.failure is None:
            try:
                self.runner.shutdown()
            except TensorParallelError:
                logger.warning("a tensor-parallel worker was already gone at shutdown")
        if self.workers is not None:
            self.workers.stop()

    def _fail_batch(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        logger.exception("engine step failed; failing the %d scheduled sequences' requests",
                         len(scheduler_output.scheduled))
        error = f"engine step failed: {type(exc).__name__}: {exc}"
        request_ids = dict.fromkeys(item.seq.request_id for item in scheduler_output.scheduled)
        return [self.output_processor.abort(request_id, error) for request_id in request_ids]

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
            prompt_tokens_total=self.output_processor.prompt_tokens_total,
            generation_tokens_total=self.output_processor.generation_tokens_total,
            num_requests_finished=dict(self.output_processor.finished_by_reason),
            spec_decode=self.scheduler.spec_stats.copy() if self.scheduler.spec_stats is not None else None,
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

