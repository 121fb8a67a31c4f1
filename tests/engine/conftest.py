"""Engine-area fixtures: tiny-model engines whose KV-block accounting is checked after every test,
a per-step invariant-checking driver, and transformers references."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember.engine.llm import LLM
from ember.engine.llm_engine import LLMEngine
from ember.engine.outputs import RequestOutput

# Every engine a test builds through these fixtures; checked after each test.
_ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()

@pytest.fixture(autouse=True)
def check_block_invariants():
    yield
    for engine in list(_ENGINES):
        engine.check_invariants()


@pytest.fixture(scope="session")
def make_llm(tiny_model_dir: Path) -> Callable[..., LLM]:
    def make(**engine_args) -> LLM:
        llm = LLM(str(tiny_model_dir), **{"dtype": "float32", "num_threads": 1, **engine_args})
        _ENGINES.add(llm.engine)
        return llm

    return make


@pytest.fixture(scope="module")
def tiny_llm(make_llm) -> LLM:
    return make_llm()


def _run_checked(engine: LLMEngine, on_step: Callable[[int], None] | None = None) -> dict[str, RequestOutput]:
    """Step until idle, checking block invariants after every step; returns each request's final output."""
    finals: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_invariants()
        step += 1
        if on_step is not None:
            on_step(step)
    engine.check_invariants()
    return finals


@pytest.fixture(scope="session")
def run_checked() -> Callable[..., dict[str, RequestOutput]]:
    return _run_checked


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir: Path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens, like ignore_eos
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on one unpadded prompt: the reference token ids."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def tiny_reference(hf_tiny) -> Callable[[list[int], int], list[int]]:
    """Cached transformers greedy continuations on the tiny model."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reference(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(hf_tiny, prompt_ids, max_new_tokens)
        return cache[key]

    return reference
