"""Time ember's native decode attention and GEMM kernels alone, over SmolLM2-135M's shapes (30 layers).

    .venv/bin/python benchmarks/engine/kernel_bandwidth.py attention [--seqs 32 --context 220 --block-size 16]
        [--queries N] [--kv-cache-dtype int8] [--in-order] [--against DIR [--trials 30]]
    .venv/bin/python benchmarks/engine/kernel_bandwidth.py gemm [--rows 32 [64 ...]] [--hot] [--dtype float32]
        [--kernels avx512] [--vs-torch] [--per-call]
    .venv/bin/python benchmarks/engine/kernel_bandwidth.py quant [--rows 1] [--format q4_1] [--kernels LEVEL]
        [--panels] [--against DIR [--trials 30]]

attention: one decode step's attention over 30 layers' caches (32 sequences of 220 tokens in scrambled
blocks, or with --in-order one after another: 162 MB of K/V, more than the caches hold), in GB/s of K/V read; --queries N > 1 times the prompt-chunk
kernel instead, N queries per sequence (a decode verifying N - 1 draft tokens); --kv-cache-dtype int8 reads an
int8 cache (its bytes, scales included, are the GB/s). gemm: the 120 Linear layers of the
30 decoder layers (qkv, o, gate_up, down) on each `--rows` count of rows, in GB/s of weights and TFLOP/s; --hot
calls one weight of each shape 30 times instead, so it stays in cache (the kernel's arithmetic rate); --vs-torch
times torch.nn.functional.linear on the same (unpacked) weights too, and in bfloat16 oneDNN on weights pre-packed
for it, as Linear calls it where the native GEMM does not run (set ONEDNN_MAX_CPU_ISA to keep oneDNN to an older
CPU's instructions); --per-call sums each call's best time instead of timing the 120 calls as one run. quant: the same 120 Linear layers with quantized weights (random blocks of `--format`)
through quant_gemm.c, in GB/s of the weights' bytes (values, scales and mins), to compare with
benchmarks/engine/read_bandwidth.c; --panels times quant_panel_gemm.c's bfloat16 panels beside it, the
dequantize + F.linear they replace, and the native GEMM on the weights dequantized to bfloat16. --kernels builds the kernels of a lower ISA level than the CPU's. Best of 10.

--against DIR (attention and quant): also build the kernels from DIR (another checkout's ember/kernels, e.g. a git
worktree at an older commit) and alternate the two trial by trial in this one process (--trials of each), printing
each one's min and median and how many paired trials this tree won: on a VM whose speed moves by tens of percent
from one minute to the next, separate runs cannot tell a 10% change apart (docs/benchmarks.md, Zen 5 again).
Used for docs/benchmarks.md, "Engine step" and "Quantized weights at run time"."""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.kernels import build
from ember.kernels.cpu import ISA_LEVELS, cpu_isa_level
from ember.kernels.native import NativeKernels
from ember.kernels.quant_gemm import GEMV_MAX_ROWS, QuantGemm, load_quant_gemm
from ember.kernels.quantized_weight import (
    BLOCK,
    BLOCK_MIN_FORMATS,
    FIVE_BIT_FORMATS,
    QUANT_FORMATS,
    SUPER_BLOCK_FORMATS,
    QuantizedWeight,
    int8_panels,
)
from ember.layers.kv_cache import allocate_kv_cache, write_kv

LAYERS, KV_HEADS, HEAD_DIM, QUERIES_PER_KV = 30, 3, 64, 3
LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs) per decoder layer


def best_time(run: Callable[[], None], repetitions: int = 10) -> float:
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(repetitions):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def alternate(runs: dict[str, Callable[[], None]], trials: int) -> dict[str, float]:
    """Each run's trials in turn, the order swapped every round; prints min and median of each and how many
    rounds the first won. Returns each run's min (seconds)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for trial in range(trials):
        for name in list(runs)[:: 1 if trial % 2 == 0 else -1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        print(f"  {name}: min {min(seconds) * 1e3:.2f} ms, median {statistics.median(seconds) * 1e3:.2f} ms")
    first, second = times.values()
    print(f"  {list(times)[0]} faster in {sum(a < b for a, b in zip(first, second, strict=True))} of {trials} rounds")
    return {name: min(seconds) for name, seconds in times.items()}


@contextlib.contextmanager
def kernels_built_from(source_dir: Path) -> Iterator[None]:
    """Kernels constructed inside load their libraries built from source_dir's C files (--against)."""
    saved = build.SOURCE_DIR
    build.SOURCE_DIR = source_dir
    build.load_kernel.cache_clear()
    try:
        yield
    finally:
        build.SOURCE_DIR = saved
        build.load_kernel.cache_clear()


def run_all(calls: list[Callable[[], object]]) -> None:
    """Each call's output is dropped at once, as a layer's is: 120 live outputs (80 MB at 256 rows) would time
    the page faults of fresh memory rather than the kernel."""
    for call in calls:
        call()


def per_call_best(calls: list[Callable[[], object]], repetitions: int = 10) -> float:
    """The sum over `calls` of each one's best time, each repetition running them all in order (so cold weights
    stay cold): on a machine other work also runs, a preemption spoils one call rather than the whole run."""
    best = [float("inf")] * len(calls)
    for _ in range(repetitions + 1):  # the first pass warms up
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return sum(best)


def attention(kernels: NativeKernels, seqs: int, context: int, block_size: int, queries: int, in_order: bool = False,
              against: tuple[str, NativeKernels] | None = None, trials: int = 30) -> None:
    blocks_per_seq = -(-context // block_size)
    num_blocks = seqs * blocks_per_seq + 8
    if kernels.kv_cache_element == torch.int8:
        caches = allocate_kv_cache(LAYERS, num_blocks, block_size, KV_HEADS, HEAD_DIM, kernels.dtype, "int8",
                                   torch.device("cpu")).unbind(0)
        for cache in caches:
            k, v = torch.randn(2, num_blocks * block_size, KV_HEADS, HEAD_DIM, dtype=kernels.dtype)
            write_kv(cache, torch.arange(num_blocks * block_size), k, v)
    else:
        caches = torch.randn(LAYERS, num_blocks, block_size, 2, KV_HEADS, HEAD_DIM, dtype=kernels.dtype).unbind(0)
    ids = list(range(num_blocks))
    if not in_order:
        random.Random(0).shuffle(ids)
    tables = torch.tensor([ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(seqs)])
    context_lens = torch.full((seqs,), context, dtype=torch.int64)
    q = torch.randn(seqs * queries, KV_HEADS * QUERIES_PER_KV, HEAD_DIM, dtype=kernels.dtype)
    query_starts = torch.arange(0, seqs * queries + 1, queries, dtype=torch.int64)

    def run(kernels: NativeKernels = kernels) -> None:
        for cache in caches:
            if queries == 1:
                kernels.paged_decode_attention(q, cache, tables, context_lens, HEAD_DIM**-0.5)
            else:
                kernels.paged_prefill_attention(q, cache, tables, query_starts, context_lens, HEAD_DIM**-0.5)

    if against:
        print(f"{seqs} x {context} tokens, {queries} queries per sequence, {block_size}-token blocks, 30 layers:")
        alternate({"this tree": run, against[0]: lambda: run(against[1])}, trials)
        return
    seconds = best_time(run)
    kv_bytes = LAYERS * seqs * context * caches[0][0, 0].numel() * caches[0].element_size()
    kind = "decode attention" if queries == 1 else f"prompt-chunk attention ({queries} queries per sequence)"
    print(f"{kind}, {seqs} x {context} tokens, {block_size}-token blocks: {seconds * 1e3:.2f} ms "
          f"for {LAYERS} layers, {kv_bytes / seconds / 1e9:.1f} GB/s of K/V")


def gemm(kernels: NativeKernels, rows: int, hot: bool, vs_torch: bool, per_call: bool) -> None:
    dtype = kernels.dtype
    inputs = {k: torch.randn(rows, k, dtype=dtype) for _, k in LINEAR_SHAPES}

    def report(label: str, weights: list[torch.Tensor]) -> None:
        packs = {id(w): kernels.pack_gemm_weight(w) for w in weights}  # --hot: one packed copy, reused
        packed = [packs[id(w)] for w in weights]
        calls = {f"native {kernels.gemm_name}": [lambda w=w, p=p: kernels.gemm(inputs[w.shape[1]], p, None)
                                                 for w, p in zip(weights, packed, strict=True)]}
        if vs_torch:
            calls["torch F.linear"] = [lambda w=w: F.linear(inputs[w.shape[1]], w) for w in weights]
            if dtype == torch.bfloat16:
                onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
                calls["oneDNN pre-packed"] = [
                    lambda w=w, o=o: torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], o, None, "none", [], "")
                    for w, o in zip(weights, onednn, strict=True)]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        flops = sum(2 * rows * w.numel() for w in weights)
        for name, layer_calls in calls.items():
            seconds = per_call_best(layer_calls) if per_call else best_time(lambda c=layer_calls: run_all(c))
            print(f"GEMM {dtype} ({name}), {rows} rows, {label}: {seconds * 1e3:.2f} ms for {len(weights)} calls, "
                  f"{weight_bytes / seconds / 1e9:.1f} GB/s of weights, {flops / seconds / 1e12:.3f} TFLOP/s")

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, dtype=dtype) * 0.02

    if hot:  # per shape: one weight, called LAYERS times
        for n, k in LINEAR_SHAPES:
            report(f"one hot {n} x {k} weight", [weight(n, k)] * LAYERS)
    else:
        report("cold weights of 30 layers", [weight(n, k) for n, k in LINEAR_SHAPES * LAYERS])


def random_quantized_weight(format: str, n: int, k: int, generator: torch.Generator) -> QuantizedWeight:
    """Random blocks of `format` (the bytes a kernel reads; their values do not change its speed)."""
    if format in ("int8", "int8_panels"):
        values = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        weight = QuantizedWeight("int8", values, torch.rand(n, generator=generator) * 0.01)
        return int8_panels(weight) if format == "int8_panels" else weight
    eight_bit = format in ("q8_0", "q8_0_min")
    # nibbles, and for the five-bit formats 8 bytes of masks per block pair (SmolLM2's widths: whole pairs)
    width = k if eight_bit else k // 2 + (k // 8 if format in FIVE_BIT_FORMATS else 0)
    values = torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=generator)
    if eight_bit:
        values = values.view(torch.int8)

    def block_floats() -> torch.Tensor:
        return (torch.rand(n, k // BLOCK, generator=generator) * 0.01).half()

    return QuantizedWeight(format, values, block_floats(), block_floats() if format in BLOCK_MIN_FORMATS else None)


def quant(kernels: QuantGemm, rows: int, format: str, panels: bool, against: tuple[str, QuantGemm] | None = None,
          trials: int = 30, dtype: torch.dtype = torch.bfloat16) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = LINEAR_SHAPES * LAYERS
    weights = [random_quantized_weight(format, n, k, generator) for n, k in shapes]
    inputs = {k: torch.randn(rows, k, dtype=dtype) for _, k in LINEAR_SHAPES}
    weight_bytes = sum(weight.nbytes for weight in weights)
    # int8 panels take float32 rows only on AVX2's W8A8 GEMM (through gemm), bfloat16 ones only as --panels.
    if format != "int8_panels":
        runs = {f"GEMV, {kernels.dot_product}": kernels.gemm}
    elif dtype == torch.float32:
        runs = {f"W8A8, {kernels.w8a8_name}": kernels.gemm}
    else:
        runs = {}
    if panels:
        runs = {**({} if rows > GEMV_MAX_ROWS else runs), f"panels on {kernels.panel_gemm_name}": kernels.panel_gemm,
                "dequantize + F.linear": lambda x, w: F.linear(x, kernels.dequantize(w, torch.bfloat16))}
    if against:  # the same entry points of the other tree's kernels, alternated
        other = {f"GEMV, {kernels.dot_product}": against[1].gemm, f"panels on {kernels.panel_gemm_name}":
                 against[1].panel_gemm, f"W8A8, {kernels.w8a8_name}": against[1].gemm}
        for name, run in runs.items():
            if name in other:
                print(f"{name}, {format}, {rows} rows, 120 calls:")
                alternate({"this tree": lambda run=run: run_all([lambda w=w, k=k: run(inputs[k], w)
                                                                  for w, (_, k) in zip(weights, shapes, strict=True)]),
                           against[0]: lambda run=other[name]: run_all([lambda w=w, k=k: run(inputs[k], w)
                                                                         for w, (_, k) in zip(weights, shapes,
                                                                                              strict=True)])},
                          trials)
        return
    for name, run in runs.items():
        seconds = best_time(lambda run=run: run_all([lambda w=w, k=k: run(inputs[k], w)
                                                     for w, (_, k) in zip(weights, shapes, strict=True)]))
        print(f"quantized GEMM (native_quant_{kernels.level}, {name}), {format}, {rows} rows, cold weights of 30 "
              f"layers ({weight_bytes / 1e6:.1f} MB): {seconds * 1e3:.2f} ms for {len(shapes)} calls, "
              f"{weight_bytes / seconds / 1e9:.1f} GB/s of weights")
    if panels:  # the same weights dequantized to bfloat16, on the native GEMM the panels run
        native = NativeKernels(HEAD_DIM, QUERIES_PER_KV, kernels.level)
        packed = [native.pack_gemm_weight(kernels.dequantize(w, torch.bfloat16)) for w in weights]
        seconds = best_time(lambda: run_all([lambda p=p, k=k: native.gemm(inputs[k], p, None)
                                             for p, (_, k) in zip(packed, shapes, strict=True)]))
        print(f"GEMM torch.bfloat16 (native {native.gemm_name}) on the same weights dequantized, {rows} rows: "
              f"{seconds * 1e3:.2f} ms for {len(shapes)} calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("attention", "gemm", "quant"))
    parser.add_argument("--seqs", type=int, default=32, help="attention: sequences")
    parser.add_argument("--context", type=int, default=220, help="attention: tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16, help="attention: tokens per KV block")
    parser.add_argument("--queries", type=int, default=1, help="attention: queries per sequence")
    parser.add_argument("--in-order", action="store_true", help="attention: each sequence's blocks one after "
                        "another in memory (as a served run's mostly are), not scrambled")
    parser.add_argument("--rows", type=int, nargs="+", default=[32], help="gemm: rows of x (one run per count)")
    parser.add_argument("--hot", action="store_true", help="gemm: one weight per shape, repeated, so it stays in cache")
    parser.add_argument("--vs-torch", action="store_true", help="gemm: time torch's F.linear too")
    parser.add_argument("--per-call", action="store_true", help="gemm: sum each call's best time (a busy machine)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="gemm, attention and quant: the dtype (attention: the KV cache's too; quant: the rows')")
    # The K-quants' rows are whole super-blocks of 256, which SmolLM2's widths (576) are not.
    parser.add_argument("--format", choices=[f for f in QUANT_FORMATS if f not in SUPER_BLOCK_FORMATS], default="q4_1",
                        help="quant: weight format")
    parser.add_argument("--panels", action="store_true", help="quant: time the bfloat16 panels, the dequantize + "
                        "F.linear they replace and the native GEMM on the dequantized weights too")
    parser.add_argument("--kernels", choices=ISA_LEVELS[1:], default=None, help="ISA level (default: the CPU's)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="attention: the cache's format, as ember serve --kv-cache-dtype (default: %(default)s)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: CPU cores)")
    parser.add_argument("--against", type=Path, default=None, metavar="DIR",
                        help="attention and quant: alternate with the kernels built from DIR (another checkout's "
                        "ember/kernels), trial by trial")
    parser.add_argument("--trials", type=int, default=30, help="--against: trials of each (default: %(default)s)")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.against and not (args.against / "paged_attention.c").is_file():
        parser.error(f"--against {args.against}: not a folder of ember's kernel sources (no paged_attention.c)")
    if args.kernel == "quant" and args.panels and args.dtype != "bfloat16":
        parser.error("quant --panels: the panels take bfloat16 rows (leave --dtype at bfloat16)")
    if args.kernel == "quant":
        def load() -> QuantGemm:
            return load_quant_gemm(args.kernels or "auto")
        kernels = load()
        if args.against:
            with kernels_built_from(args.against):
                against = (str(args.against), load())
        for rows in args.rows:
            quant(kernels, rows, args.format, args.panels, against if args.against else None, args.trials,
                  getattr(torch, args.dtype))
        return

    def native() -> NativeKernels:
        return NativeKernels(HEAD_DIM, QUERIES_PER_KV, args.kernels or cpu_isa_level(), getattr(torch, args.dtype),
                             kv_cache_dtype=args.kv_cache_dtype)
    kernels = native()
    if args.kernel == "attention":
        other = None
        if args.against:
            with kernels_built_from(args.against):
                other = (str(args.against), native())
        attention(kernels, args.seqs, args.context, args.block_size, args.queries, args.in_order, other, args.trials)
    else:
        for rows in args.rows:
            gemm(kernels, rows, args.hot, args.vs_torch, args.per_call)


if __name__ == "__main__":
    main()
