"""Tensor parallelism on CPU (issue 18): tp=1 on every core vs tp=2 with one core per rank, all-reduce through
shared memory or gloo; decode throughput at concurrency 1 and 32, and the all-reduce's share of rank 0's step
time. Run: PYTHONPATH=. python benchmarks/engine/tensor_parallel_cpu.py MODEL [DTYPE]"""

from __future__ import annotations

import json
import os
import sys
import time

from ember import LLM, SamplingParams

PROMPT_LEN, OUTPUT_LEN = 32, 64


def run(model: str, dtype: str, concurrency: int, **engine_args) -> dict[str, float]:
    llm = LLM(model, dtype=dtype, max_num_seqs=concurrency, **engine_args)
    group = llm.engine.workers.group if llm.engine.workers else None
    all_reduce_s = [0.0]
    if group is not None:  # time rank 0's all-reduces (the workers wait in theirs just as long)
        timed = group.all_reduce

        def all_reduce(tensor):
            started = time.perf_counter()
            result = timed(tensor)
            all_reduce_s[0] += time.perf_counter() - started
            return result

        group.all_reduce = all_reduce
    prompts = [[100 + (i * 7 + j) % 4000 for j in range(PROMPT_LEN)] for i in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    all_reduce_s[0] = 0.0
    started = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    llm.engine.shutdown()
    return {"output_tok_s": round(concurrency * OUTPUT_LEN / elapsed, 1),
            "ms_per_step": round(1000 * elapsed / OUTPUT_LEN, 1),
            "all_reduce_share": round(all_reduce_s[0] / elapsed, 3)}


if __name__ == "__main__":
    model, dtype = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "float32"
    cores = sorted(os.sched_getaffinity(0))
    configs = {
        "tp1 (2 cores)": {"num_threads": len(cores)},
        "tp2 shm (1 core each)": {"tensor_parallel_size": 2, "tensor_parallel_all_reduce": "shm"},
        "tp2 gloo (1 core each)": {"tensor_parallel_size": 2, "tensor_parallel_all_reduce": "gloo"},
    }
    for concurrency in (1, 32):
        for name, engine_args in configs.items():
            result = run(model, dtype, concurrency, **engine_args)
            os.sched_setaffinity(0, cores)  # tp=2 bound this process (rank 0) to its core
            print(json.dumps({"config": name, "concurrency": concurrency, **result}), flush=True)
