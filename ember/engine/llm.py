"""The offline API: `LLM(model).generate(prompts, params)`, vLLM's shape."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from ember.engine.args import EngineArgs
from ember.engine.llm_engine import LLMEngine
from ember.engine.outputs import RequestOutput
from ember.engine.sampling_params import SamplingParams
from ember.loader.tokenizer import Tokenizer

Prompt = str | list[int]
Conversation = list[dict[str, Any]]


class LLM:
    """Run a model over a batch of prompts in this process (continuous batching inside one call)."""

    def __init__(self, model: str = EngineArgs.model, dtype: str = "auto", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, dtype=dtype, **engine_args))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        return self._run(prompts, params_list, priorities, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: SamplingParams
             | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True, **chat_template_kwargs: Any) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, **chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[Prompt], params_list: list[SamplingParams], priorities: list[int],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for index, (prompt, params, priority) in enumerate(zip(prompts, params_list, priorities, strict=True)):
                request_id = str(next(self._request_counter))
                # Only the final output is needed here: skip building per-step outputs.
                engine.add_request(request_id, prompt, dataclasses.replace(params, output_kind="final"), priority)
                order[request_id] = index
            results: list[RequestOutput | None] = [None] * len(prompts)
            progress = _progress(len(prompts)) if use_tqdm else None
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        if output.error is not None:
                            raise RuntimeError(f"request {order[output.request_id]} failed: {output.error}")
                        results[order[output.request_id]] = output
                        if progress is not None:
                            progress.update(1)
            if progress is not None:
                progress.close()
            return results
        finally:
            engine.abort_request([request_id for request_id in order if request_id in engine.requests])


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req")
