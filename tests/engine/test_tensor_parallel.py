"""Tensor parallelism on CPU: two ranks (the engine process and one spawned worker; all-reduce through shared
memory, or gloo) give the tokens one rank gives in float32, under batching, chunked prefill, prefix-cache
hits, preemption and speculative decoding, greedy and seeded sampling; a worker killed mid-run fails the
engine at once."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.parallel import TensorParallelError
from ember.engine.shm_allreduce import shm_path
from ember.errors import EmberError
from tests.conftest import build_tiny_model_dir
from tests.engine.test_engine_greedy_tiny import PROMPTS, kv_gib, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARED_PREFIX = make_prompts(7, [40])[0]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def make_tp_llm(tiny_model_dir):
    """Builds LLMs on the tiny model (float32, one thread per rank) and stops their workers afterwards."""
    built: list[LLM] = []

    def make(model: str = str(tiny_model_dir), **engine_args) -> LLM:
        llm = LLM(model, **{"dtype": "float32", "num_threads": 1, **engine_args})
        built.append(llm)
        return llm

    yield make
    for llm in built:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "engine_args",
    [
        {},  # every prompt in one batch, all-reduced through shared memory
        {"tensor_parallel_all_reduce": "gloo"},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"kv_cache_memory": kv_gib(24), "enable_prefix_caching": False},  # preemption
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}},
        # A scale per token and KV head: each rank's heads quantize as one rank's do.
        {"kv_cache_dtype": "int8", "max_num_batched_tokens": 16},
    ],
    ids=["batch", "batch-gloo", "chunked-prefill", "preemption", "ngram-speculation", "int8-kv-cache"],
)
def test_two_ranks_give_one_rank_greedy_tokens(make_tp_llm, engine_args):
    # Repetitive prompts give the n-gram proposer drafts to verify.
    prompts = PROMPTS + [list(range(100, 110)) * 4]
    expected = generate(make_tp_llm(**engine_args), prompts)
    tp_llm = make_tp_llm(tensor_parallel_size=2, **engine_args)
    assert generate(tp_llm, prompts) == expected
    stats = tp_llm.engine.stats()
    if "kv_cache_memory" in engine_args:
        assert stats.num_preempted_total > 0
    if "speculative_config" in engine_args:
        assert stats.spec_decode.num_accepted_tokens > 0


def test_prefix_cache_hits_and_seeded_sampling_match_one_rank(make_tp_llm):
    prompts = [SHARED_PREFIX + p for p in make_prompts(3, [2, 5, 9, 17])]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    one, two = make_tp_llm(), make_tp_llm(tensor_parallel_size=2)
    for llm in (one, two):
        generate(llm, prompts[:1])  # caches the shared prefix
    assert generate(two, prompts) == generate(one, prompts)
    assert two.engine.stats().prefix_cache_hits > 0
    assert generate(two, prompts, sampled) == generate(one, prompts, sampled)


def test_fewer_kv_heads_than_ranks_replicates_them(make_tp_llm, tmp_path):
    model = build_tiny_model_dir(tmp_path / "one-kv-head", num_key_value_heads=1)
    expected = generate(make_tp_llm(str(model)), PROMPTS[:6])
    tp_llm = make_tp_llm(str(model), tensor_parallel_size=2)
    assert tp_llm.engine.runner.kv_cache.shape[4] == 1  # the KV head, replicated on both ranks
    assert generate(tp_llm, PROMPTS[:6]) == expected


def test_each_rank_holds_its_shard(make_tp_llm):
    llm = make_tp_llm(tensor_parallel_size=2)
    model = llm.engine.runner.model
    # tiny model: 4 heads, 2 KV heads of 16 dims, intermediate 128, vocabulary 49152 -> rank 0's halves
    assert model.layers[0].self_attn.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 64)
    assert model.layers[0].mlp.down_proj.weight.shape == (64, 64)
    assert model.embed_tokens.weight.shape == (49152 // 2, 64)
    assert llm.engine.runner.kv_cache.shape[4] == 1


def test_the_engine_process_has_its_cores_back_after_shutdown(tiny_model_dir):
    """Rank 0 runs on its share of the cores while the group lives; an offline LLM's process goes on after the
    engine with all of them (before, it stayed on rank 0's: every later engine in it ran on one core)."""
    before = os.sched_getaffinity(0)
    llm = LLM(str(tiny_model_dir), dtype="float32", num_threads=1, tensor_parallel_size=2)
    assert os.sched_getaffinity(0) == set(sorted(before)[: max(1, len(before) // 2)])
    llm.engine.shutdown()
    assert os.sched_getaffinity(0) == before


def test_sizes_that_do_not_split_are_refused(tiny_model_dir):
    with pytest.raises(EmberError, match="tensor_parallel_size 3 exceeds the model's 2 KV heads"):
        LLM(str(tiny_model_dir), dtype="float32", tensor_parallel_size=3)
    with pytest.raises(EmberError, match="cpu_bind names 1 core list"):
        LLM(str(tiny_model_dir), dtype="float32", tensor_parallel_size=2, cpu_bind="0")


def test_a_worker_that_fails_to_start_fails_the_engine_at_once(tiny_model_dir):
    cores = os.sched_getaffinity(0)
    started = time.monotonic()
    # Core 4096 does not exist: the worker's sched_setaffinity fails before it joins.
    with pytest.raises(TensorParallelError, match=r"worker died while starting: ember-tp-rank1 .* code 1"):
        LLM(str(tiny_model_dir), dtype="float32", tensor_parallel_size=2, cpu_bind=f"{min(cores)}|4096")
    assert os.sched_getaffinity(0) == cores  # rank 0 (this process) was bound to its core, and is no longer
    assert time.monotonic() - started < 60
    assert not glob.glob(shm_path(f"{os.getpid()}-*"))  # the shared-memory file was removed


def test_a_killed_worker_fails_the_engine_without_hanging(make_tp_llm):
    llm = make_tp_llm(tensor_parallel_size=2)
    engine = llm.engine
    assert generate(llm, PROMPTS[:2])
    worker = engine.workers.processes[0]
    engine.add_request("doomed", PROMPTS[3], GREEDY)
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"ember-tp-rank1 .* exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 60  # a hang guard, not a speed check
    assert "exited with code -9" in engine.failure


@pytest.mark.slow
def test_smollm2_two_ranks_match_one_rank(smollm2_gguf_path, make_tp_llm):
    """SmolLM2-135M's 9 heads and 3 KV heads split unevenly: 1 KV head (3 query heads) on rank 0, 2 on rank 1.
    Both on the weights dequantized at load (what quantization auto means under tensor parallelism)."""
    tokenizer_llm = make_tp_llm(str(smollm2_gguf_path), quantization="none")
    tokenizer = tokenizer_llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Water boils at"]
    prompts = [tokenizer.encode(text) for text in texts]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = generate(tokenizer_llm, prompts, params)
    tp_llm = make_tp_llm(str(smollm2_gguf_path), tensor_parallel_size=2)
    assert tp_llm.engine.runner.model.layers[0].self_attn.num_heads == 3
    assert generate(tp_llm, prompts, params) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"the NCCL path needs two CUDA GPUs; this host has {torch.cuda.device_count()}")
def test_two_gpus_over_nccl_match_one(make_tp_llm):
    expected = generate(make_tp_llm(device="cuda"), PROMPTS[:4])
    assert generate(make_tp_llm(device="cuda", tensor_parallel_size=2), PROMPTS[:4]) == expected
