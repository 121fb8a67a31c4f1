"""AsyncEngine: concurrent streams, aborts (explicit and by closing the stream) free blocks at once,
the event loop keeps running while the engine thread works, step failures fail only their requests."""

from __future__ import annotations

import asyncio
import random

import pytest

from ember import SamplingParams
from ember.engine.async_engine import AsyncEngine
from ember.engine.errors import EngineDeadError, EngineRequestError, InvalidRequestError, PromptTooLongError


@pytest.fixture
async def engine(tiny_llm):
    async_engine = AsyncEngine(tiny_llm.engine)
    await async_engine.start()
    yield async_engine
    await wait_idle(async_engine)
    await async_engine.shutdown()


async def wait_idle(engine: AsyncEngine) -> None:
    """Wait (bounded) until the engine thread has drained its inbox and every request."""
    for _ in range(2000):
        stats = engine.stats()
        if not engine._inbox and stats.num_running == stats.num_waiting == 0 \
                and not engine.engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine did not become idle")


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


async def test_concurrent_generates_stream_greedy_reference_tokens(engine, tiny_reference):
    batch = prompts(1, [5, 17, 33, 48, 9])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="delta")

    async def consume(i: int, prompt: list[int]):
        chunks = []
        async for out in engine.generate(prompt, params, f"s{i}"):
            chunks.append(out)
        return chunks

    results = await asyncio.gather(*(consume(i, p) for i, p in enumerate(batch)))
    for prompt, chunks in zip(batch, results, strict=True):
        assert len(chunks) == 12  # one output per generated token: streamed, not buffered
        assert [c.finished for c in chunks] == [False] * 11 + [True]
        tokens = [t for c in chunks for t in c.outputs[0].token_ids]
        assert tokens == tiny_reference(prompt, 12)
        text = "".join(c.outputs[0].text for c in chunks)
        assert text == engine.tokenizer.decode(tokens)
        assert chunks[-1].outputs[0].finish_reason == "length"
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


async def test_abort_mid_stream_frees_blocks_and_ends_with_abort(engine):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    seen = []
    async for out in engine.generate([7, 8, 9, 10], params, "long"):
        seen.append(out)
        if len(seen) == 3:
            assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
            await engine.abort("long")
    final = seen[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 3 <= len(final.outputs[0].token_ids) < 500
    stats = engine.stats()  # the snapshot taken when the abort was processed
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    engine.engine.check_invariants()


async def test_closing_the_stream_aborts_the_request(engine):
    aborts_before = engine.stats().num_requests_finished["abort"]
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    stream = engine.generate([7, 8, 9, 10, 11], params, "closed")
    count = 0
    async for _ in stream:
        count += 1
        if count == 2:
            break
    await stream.aclose()
    await wait_idle(engine)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_requests_finished["abort"] == aborts_before + 1


async def test_event_loop_keeps_ticking_while_the_engine_works(engine):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker_task = asyncio.create_task(ticker())
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ticks_at_outputs = []

    async def consume(i: int, prompt: list[int]):
        async for _ in engine.generate(prompt, params, f"t{i}"):
            ticks_at_outputs.append(ticks)

    await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts(2, [30, 60, 90, 120]))))
    ticker_task.cancel()
    # The ticker ran between the first and the last output: steps never blocked the loop.
    assert ticks_at_outputs[-1] > ticks_at_outputs[0]
    assert len(set(ticks_at_outputs)) > 1


async def test_bad_requests_raise_before_streaming(engine):
    with pytest.raises(PromptTooLongError, match="maximum context length"):
        async for _ in engine.generate(list(range(3, 3 + engine.max_model_len)), SamplingParams(), "big"):
            pass
    stream = engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), "dup")
    await stream.__anext__()
    with pytest.raises(InvalidRequestError, match="already in use"):
        async for _ in engine.generate([1, 2], SamplingParams(), "dup"):
            pass
    await stream.aclose()


async def test_a_failing_step_fails_its_requests_and_the_engine_lives_on(engine, monkeypatch, tiny_reference):
    runner = engine.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def failing_once(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected device failure")
        return real_execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", failing_once)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(EngineRequestError, match="injected device failure"):
        async for _ in engine.generate([4, 5, 6], params, "doomed"):
            pass
    await wait_idle(engine)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    outputs = [out async for out in engine.generate([4, 5, 6], params, "after")]
    assert outputs[-1].outputs[0].token_ids == tiny_reference([4, 5, 6], 8)


async def test_generate_after_shutdown_raises(tiny_llm):
    async_engine = AsyncEngine(tiny_llm.engine)
    with pytest.raises(EngineDeadError, match="not running"):
        async for _ in async_engine.generate([1, 2], SamplingParams(), "x"):
            pass
    await async_engine.start()
    await async_engine.shutdown()
    with pytest.raises(EngineDeadError):
        async for _ in async_engine.generate([1, 2], SamplingParams(), "y"):
            pass
