"""ModelRunner end to end on the tiny model: paged KV cache, chunked prefill mixed with decodes, greedy tokens
and logprobs against transformers, KV-cache sizing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ember.engine.args import EngineArgs
from ember.engine.model_runner import ModelRunner
from ember.engine.sampler import SampledToken
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import ScheduledSeq, SchedulerOutput
from ember.engine.sequence import Sequence
from ember.errors import EmberError
from ember.loader import load_model

BLOCK_SIZE = 4


def make_runner(model_dir: Path, dtype: str = "float32", **args) -> ModelRunner:
    loaded = load_model(model_dir, dtype=dtype)
    engine_args = EngineArgs(model=str(model_dir), dtype=dtype, device="cpu", block_size=BLOCK_SIZE,
                             num_threads=1, **{"kv_cache_memory": 0.01, **args})
    return ModelRunner(loaded.config, loaded.state_dict, engine_args)


def generate(runner: ModelRunner, prompts: list[list[int]], max_new: int, chunk: int,
             params: SamplingParams) -> list[tuple[Sequence, list[SampledToken]]]:
    """Drive the runner like the engine does: decodes first, then prefill chunks of at most `chunk` tokens,
    blocks handed out in a shuffled order so block tables are never contiguous."""
    free = list(range(runner.num_blocks))
    random.Random(0).shuffle(free)
    seqs = [Sequence(f"r{i}", i, 0, prompt, params,
                     generator=None if params.seed is None else torch.Generator().manual_seed(params.seed))
            for i, prompt in enumerate(prompts)]
    sampled: list[list[SampledToken]] = [[] for _ in seqs]
    while any(seq.num_output_tokens < max_new for seq in seqs):
        active = [seq for seq in seqs if seq.num_output_tokens < max_new]
        decodes = [ScheduledSeq(seq, 1, True) for seq in active if seq.num_output_tokens > 0]
        prefills = []
        for seq in active:
            if seq.num_output_tokens == 0:
                count = min(chunk, seq.num_tokens - seq.num_computed_tokens)
                prefills.append(ScheduledSeq(seq, count, seq.num_computed_tokens + count == seq.num_tokens))
        scheduled = decodes + prefills
        for item in scheduled:
            needed = item.seq.num_computed_tokens + item.num_new_tokens
            while len(item.seq.block_table) * BLOCK_SIZE < needed:
                item.seq.block_table.append(free.pop())
        results = runner.execute(SchedulerOutput(scheduled, sum(item.num_new_tokens for item in scheduled))).sampled
        assert len(results) == len(scheduled)
        for item, tokens in zip(scheduled, results, strict=True):
            assert (tokens is None) == (not item.sample)
            item.seq.num_computed_tokens += item.num_new_tokens
            if tokens is not None:
                (token,) = tokens  # no draft tokens: one token each
                item.seq.token_ids.append(token.token_id)
                sampled[seqs.index(item.seq)].append(token)
    return list(zip(seqs, sampled, strict=True))


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(42)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def test_greedy_tokens_and_logprobs_match_transformers_with_chunked_prefill(
    tiny_model_dir: Path, hf_llama: torch.nn.Module
) -> None:
    runner = make_runner(tiny_model_dir)
    params = SamplingParams(temperature=0.0, logprobs=3)
    # Chunks of 6: prompts of 17 and 13 end with a 5- and a 1-token chunk, mixed with running decodes.
    results = generate(runner, prompts((5, 17, 30, 13, 1)), max_new=7, chunk=6, params=params)
    for seq, tokens in results:
        with torch.inference_mode():
            logits = hf_llama(torch.tensor([seq.token_ids])).logits[0]
        reference = logits[seq.num_prompt_tokens - 1 : -1].log_softmax(dim=-1)
        assert seq.output_token_ids == reference.argmax(dim=-1).tolist()
        for step, token in enumerate(tokens):
            assert token.rank == 1
            assert token.logprob == pytest.approx(reference[step, token.token_id].item(), abs=1e-4)
            values, indices = reference[step].topk(3)
            assert [t for t, _ in token.top_logprobs] == indices.tolist()
            assert [lp for _, lp in token.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir)
    params = SamplingParams(temperature=1.0, seed=77)

    def sample(prompt_lengths: tuple[int, ...]) -> list[int]:
        seq, _ = generate(runner, prompts(prompt_lengths), max_new=6, chunk=5, params=params)[0]
        return seq.output_token_ids

    alone = sample((9,))
    assert alone == sample((9,))
    assert alone == sample((9, 4, 21))


def test_bfloat16_runner_stays_close_to_transformers(tiny_model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    runner = make_runner(tiny_model_dir, dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.dtype == torch.bfloat16
    (seq, tokens), = generate(runner, prompts((11,)), max_new=4, chunk=4,
                              params=SamplingParams(temperature=0.0, logprobs=0))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([seq.token_ids])).logits[0].float()
    reference = logits[seq.num_prompt_tokens - 1 : -1].log_softmax(dim=-1)
    for step, token in enumerate(tokens):
        assert token.logprob == pytest.approx(reference[step, token.token_id].item(), abs=0.1)


def test_kv_cache_is_sized_from_kv_cache_memory(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, kv_cache_memory=0.001)
    config = runner.config
    bytes_per_block = 2 * config.num_hidden_layers * config.num_key_value_heads * BLOCK_SIZE * config.head_dim * 4
    assert runner.num_blocks == int(0.001 * (1 << 30)) // bytes_per_block
    assert runner.kv_cache.shape == (config.num_hidden_layers, runner.num_blocks, BLOCK_SIZE, 2,
                                     config.num_key_value_heads, config.head_dim)
    with pytest.raises(EmberError, match="holds no KV block"):
        make_runner(tiny_model_dir, kv_cache_memory=1e-9)


def test_an_int8_kv_cache_holds_a_row_of_int8_values_and_scales_per_token(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, kv_cache_memory=0.001, kv_cache_dtype="int8")
    config = runner.config
    row_bytes = 2 * config.num_key_value_heads * config.head_dim + 2 * config.num_key_value_heads * 4
    assert runner.num_blocks == int(0.001 * (1 << 30)) // (config.num_hidden_layers * BLOCK_SIZE * row_bytes)
    assert runner.kv_cache.shape == (config.num_hidden_layers, runner.num_blocks, BLOCK_SIZE, row_bytes)
    assert runner.kv_cache.dtype == torch.int8 and runner.kv_cache_dtype == "int8"
    assert runner.cache_config["cache_dtype"] == "int8"
