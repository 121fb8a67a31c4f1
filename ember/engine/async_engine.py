"""The asyncio front of the engine.

One dedicated thread owns the LLMEngine and runs its step loop; the event loop never runs a model
step. Requests and aborts cross into the thread through a lock-protected inbox (the thread sleeps
on a condition variable while there is no work); each step's outputs cross back with ONE
loop.call_soon_threadsafe, which fans them out to per-request asyncio queues."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from ember.engine.args import EngineArgs
from ember.engine.errors import EngineDeadError, EngineRequestError, InvalidRequestError
from ember.engine.llm_engine import LLMEngine, PreparedRequest
from ember.engine.outputs import EngineStats, RequestOutput
from ember.engine.parallel import TensorParallelError
from ember.engine.sampling_params import SamplingParams
from ember.engine.structured_output.spec import StructuredOutputSpec

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.source = engine.source  # where the model was loaded from
        self.runner = engine.runner  # read-only here: its dtype and kernel paths, for reporting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Condition()
        self._inbox: list[tuple[str, object]] = []  # ("add", PreparedRequest) | ("abort", request_id)
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # event loop only
        self._stats = engine.stats()
        self._dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(_build_off_this_thread(args))

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still streaming end with EngineDeadError."""
        thread = self._thread
        if thread is None:
            return
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        await asyncio.to_thread(thread.join)
        await asyncio.to_thread(self.engine.shutdown)
        self._thread = None
        self._fail_all_streams(EngineDeadError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.engine.failure is None)

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve any more (its thread died, a tensor-parallel worker died); None while
        it can, or after a deliberate shutdown."""
        if self._dead_error is not None:
            return self._dead_reason()
        return self.engine.failure

    # ---- requests -----------------------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int], param: str = "prompt") -> None:
        """The checks generate() applies to a prompt, for callers that refuse a request before queueing it;
        raises InvalidRequestError with `param` as the field's name."""
        self.engine.check_prompt(prompt_token_ids, param)

    def compile_structured_output(self, spec: StructuredOutputSpec) -> None:
        """Compile spec's grammar into the engine's cache (safe from any thread); InvalidRequestError naming
        spec.param if it does not compile."""
        self.engine.structured_output.compile(spec)

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        """Raise InvalidTokenIdError if a token id is outside the vocabulary."""
        self.engine.check_token_ids(token_ids, param)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last has finished=True. Raises InvalidRequestError for a bad
        request, EngineRequestError when the engine failed it, EngineDeadError when it is not running.
        Closing the generator early aborts the request."""
        if not self.is_running:
            raise EngineDeadError(self._dead_reason())
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        # Tokenizing and validating here keeps bad requests out of the engine and raises to the caller.
        prepared = self.engine.prepare_request(request_id, prompt, params, priority)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._post("add", prepared)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise EngineRequestError(item.error)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._post("abort", request_id)

    async def abort(self, request_id: str) -> None:
        """Abort now: blocks are freed by the engine thread right away; the request's stream then ends
        with an output whose finish_reason is "abort". Unknown or finished ids are ignored."""
        self._post("abort", request_id)

    def stats(self) -> EngineStats:
        """The snapshot taken after the engine's latest step (cheap; safe from any thread)."""
        return self._stats

    # ---- plumbing -----------------------------------------------------------------------------

    def _post(self, kind: str, payload: object) -> None:
        with self._wakeup:
            self._inbox.append((kind, payload))
            self._wakeup.notify()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wakeup:
                    while not self._inbox and not self._stopping and not engine.has_unfinished_requests():
                        self._wakeup.wait()
                    if self._stopping:
                        return
                    commands, self._inbox = self._inbox, []
                outputs: list[RequestOutput | tuple[str, BaseException]] = []
                for kind, payload in commands:
                    if kind == "add":
                        try:
                            engine.add_prepared_request(payload)
                        except ValueError as exc:
                            assert isinstance(payload, PreparedRequest)
                            outputs.append((payload.request_id, exc))
                    else:
                        outputs.extend(engine.abort_request(payload))
                if engine.has_unfinished_requests():
                    try:
                        outputs.extend(engine.step())
                    except TensorParallelError:
                        raise  # a rank is gone: the engine is dead, not one step
                    except Exception as exc:  # noqa: BLE001 - a bug outside the model step: fail all, go on
                        logger.exception("engine step failed; failing every unfinished request")
                        error = EngineRequestError(f"engine step failed: {type(exc).__name__}: {exc}")
                        outputs.extend((request_id, error) for request_id in list(engine.requests))
                        engine.abort_request(list(engine.requests))
                self._stats = engine.stats()
                if outputs and not self._deliver(self._dispatch, outputs):
                    return
        except BaseException as exc:
            logger.exception("the engine thread died")
            self._dead_error = exc
            self._deliver(self._fail_all_streams, EngineDeadError(f"the engine thread died: {exc!r}"))
            raise

    def _deliver(self, callback: Callable[[Any], None], argument: Any) -> bool:
        """Hand `argument` to `callback` on the event loop; False when the loop is gone (nobody to serve)."""
        try:
            self._loop.call_soon_threadsafe(callback, argument)
        except RuntimeError:  # the event loop was closed without shutdown()
            logger.warning("event loop closed under a running engine; stopping the engine thread")
            return False
        return True

    def _dispatch(self, outputs: list[RequestOutput | tuple[str, BaseException]]) -> None:
        streams = self._streams
        for output in outputs:
            if isinstance(output, tuple):
                request_id, item = output
            else:
                request_id, item = output.request_id, output
            stream = streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    def _fail_all_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    def _dead_reason(self) -> str:
        if self._dead_error is not None:
            return f"the engine thread died: {self._dead_error!r}"
        return "the engine is not running (call start())" if self._thread is None else "the engine is stopping"


def _build_off_this_thread(args: EngineArgs) -> LLMEngine:
    """Build the engine (load, convert and pack the weights) in a short-lived thread, not the caller's.

    libgomp gives each thread that runs a parallel region its own pool of OpenMP workers, and once the
    pools hold more threads than there are cores it stops spin-waiting between regions. A model step runs
    hundreds of small parallel regions, so a pool left behind by the event loop's thread (from loading the
    weights there) made every step of the engine thread far slower (docs/benchmarks.md). A finished thread's
    pool goes away with it; the event loop's thread then never runs torch at all."""
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["engine"] = LLMEngine(args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            built["error"] = exc

    loader = threading.Thread(target=build, name="ember-engine-load")
    loader.start()
    loader.join()
    if "error" in built:
        raise built["error"]
    return built["engine"]
