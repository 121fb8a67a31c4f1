"""Engine configuration: one dataclass shared by the offline API, the CLI and the server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ember.engine.resources import DEFAULT_MAX_MODEL_LEN_CAP
from ember.errors import EmberError
from ember.kernels import KERNEL_CHOICES
from ember.kernels.cpu import cpu_isa_level, kernel_level

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
# none: float weights (a GGUF file's blocks dequantized at load); gguf: a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/
# Q4_K/Q5_K/Q6_K Linear weights kept in their blocks; int8: every Linear weight quantized per output channel at load.
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8")
# auto: the model's dtype; int8: a scale per token and KV head (ember/layers/kv_cache.py).
KV_CACHE_DTYPE_CHOICES = ("auto", "int8")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
TP_ALL_REDUCE_CHOICES = ("shm", "gloo")
# A server's default step budget is smaller than the offline API's, as vLLM's defaults differ by usage
# context: short steps let a new request's prefill start (and its first token come out) sooner and keep
# running streams' inter-token latency low, at some cost in prefill throughput (measured in
# docs/benchmarks.md, "The server's step budget").
SERVING_MAX_NUM_BATCHED_TOKENS = 256


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config for its "ngram" method (prompt lookup; ember/engine/ngram_proposer.py).

    Either lookup bound alone sets both; neither gives vLLM's default of 5."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise EmberError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        lookup_min, lookup_max = self.prompt_lookup_min, self.prompt_lookup_max
        if lookup_min is None:
            lookup_min = 5 if lookup_max is None else lookup_max
        if lookup_max is None:
            lookup_max = lookup_min
        object.__setattr__(self, "prompt_lookup_min", lookup_min)
        object.__setattr__(self, "prompt_lookup_max", lookup_max)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EmberError(f"speculative_config.{name} must be an integer of at least 1, got {value!r}")
        if lookup_min > lookup_max:
            raise EmberError(f"speculative_config.prompt_lookup_min ({lookup_min}) must not exceed "
                             f"prompt_lookup_max ({lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict (the offline API) or a JSON object (the CLI); None and {} turn speculation off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise EmberError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise EmberError(f"speculative_config must be a JSON object, got {value!r}")
        if not value:
            return None
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise EmberError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise EmberError("speculative_config needs num_speculative_tokens")
        return cls(**value)


@dataclass
class EngineArgs:
    model: str = "smollm2-135m-instruct"  # alias, HF folder or .gguf
    dtype: str = "auto"  # auto: bfloat16 on CPU where supported; never float16 on CPU (far slower)
    device: str = "auto"  # auto -> cuda if available else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped (resources.py)
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB; default sized by the model runner
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPE_CHOICES
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; default: os.cpu_count()
    # auto: ember's native CPU kernels where they can run, else torch ops; an ISA level forces that level's.
    # EMBER_KERNELS sets the default (tests run every path the machine can).
    kernels: str = field(default_factory=lambda: os.environ.get("EMBER_KERNELS", "auto"))
    seed: int = 0
    # Linear weights run quantized (ember/kernels/quant_gemm.c) on CPU: QUANTIZATION_CHOICES.
    quantization: str = "auto"
    # Speculative decoding; a dict or JSON object is turned into a SpeculativeConfig. None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Tensor parallelism: the model's layers split across this many ranks (ember/engine/parallel.py).
    tensor_parallel_size: int = 1
    # CPU cores of each rank, "0-3|4-7" (vLLM's VLLM_CPU_OMP_THREADS_BIND); default: the cores split evenly.
    cpu_bind: str | None = None
    # On CPU: shm = through shared memory (ember/engine/shm_allreduce.py), gloo = torch.distributed's. CUDA: NCCL.
    tensor_parallel_all_reduce: str = "shm"

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.cpu_bind is not None:
            core_lists = parse_cpu_bind(self.cpu_bind)
            if len(core_lists) != self.tensor_parallel_size:
                raise EmberError(f"cpu_bind names {len(core_lists)} core list(s) for tensor_parallel_size "
                                 f"{self.tensor_parallel_size}: give one per rank, separated by '|'")
        if self.dtype not in DTYPE_CHOICES:
            raise EmberError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.device not in DEVICE_CHOICES and not self.device.startswith("cuda:"):
            raise EmberError(f"device must be one of {', '.join(DEVICE_CHOICES)} or cuda:N, got {self.device!r}")
        if self.tensor_parallel_all_reduce not in TP_ALL_REDUCE_CHOICES:
            raise EmberError(f"tensor_parallel_all_reduce must be one of {', '.join(TP_ALL_REDUCE_CHOICES)}, "
                             f"got {self.tensor_parallel_all_reduce!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise EmberError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise EmberError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        try:
            kernel_level(self.kernels, cpu_isa_level())
        except ValueError as exc:
            raise EmberError(str(exc)) from None
        self._check_quantization()
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        if self.num_threads is not None:
            positive["num_threads"] = self.num_threads
        for name, value in positive.items():
            if value < 1:
                raise EmberError(f"{name} must be at least 1, got {value}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise EmberError(f"kv_cache_memory must be positive (GiB), got {self.kv_cache_memory}")

    def quantization_for(self, device_type: str) -> str:
        """What --quantization means on a device of `device_type` ("cpu", "cuda"): "auto" keeps a GGUF file's
        blocks only on CPU, with the native kernels and without tensor parallelism; elsewhere it is "none"."""
        if self.quantization == "auto" and (device_type != "cpu" or self.kernels == "torch"
                                            or self.tensor_parallel_size > 1):
            return "none"
        return self.quantization

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATION_CHOICES:
            raise EmberError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.quantization in ("auto", "none"):
            return
        if self.device.startswith("cuda"):
            raise EmberError(f"quantization {self.quantization} runs on CPU kernels only; use --quantization none "
                             f"on {self.device}")
        if self.kernels == "torch":
            raise EmberError(f"quantization {self.quantization} runs on ember's native kernels, which --kernels "
                             f"torch turns off")
        if self.tensor_parallel_size > 1:
            raise EmberError(f"quantization {self.quantization} is not supported with tensor parallelism "
                             f"(tensor_parallel_size {self.tensor_parallel_size})")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, serving: bool = False) -> None:
        """Add one kebab-case flag per field (--max-num-seqs ...) to `parser`; `serving` takes the online
        server's defaults where they differ from the offline API's."""
        defaults = EngineArgs()
        if serving:
            defaults.max_num_batched_tokens = SERVING_MAX_NUM_BATCHED_TOKENS
        group = parser.add_argument_group("engine")
        group.add_argument("--model", default=defaults.model,
                           help="model alias, Hugging Face folder or .gguf file (default: %(default)s)")
        group.add_argument("--dtype", default=defaults.dtype, choices=DTYPE_CHOICES,
                           help="weight and activation dtype; auto = bfloat16 on CPUs that support it")
        group.add_argument("--device", default=defaults.device,
                           help="auto, cpu, cuda or cuda:N (auto picks cuda when available)")
        group.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                           help="longest prompt + completion in tokens (default: the model's, capped at "
                                f"{DEFAULT_MAX_MODEL_LEN_CAP})")
        group.add_argument("--block-size", type=int, default=defaults.block_size,
                           help="tokens per paged KV-cache block (default: %(default)s)")
        group.add_argument("--kv-cache-memory", type=float, default=defaults.kv_cache_memory,
                           help="KV-cache size in GiB (default: sized from max-num-seqs and max-model-len)")
        group.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=KV_CACHE_DTYPE_CHOICES,
                           help="how K and V are cached: auto = in the model's dtype; int8 = int8 values with a "
                                "float32 scale per token and KV head (about half of bfloat16's bytes: twice the "
                                "tokens in the same memory, and decode attention reads half as much; outputs "
                                "may differ slightly from auto's) (default: %(default)s)")
        group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                           help="most sequences in one step's batch (default: %(default)s)")
        group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                           help="token budget of one step: decodes plus prefill chunks; smaller gives lower "
                                "time to first token and inter-token latency, larger more prefill throughput "
                                "(default: %(default)s)")
        group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                           default=defaults.enable_prefix_caching,
                           help="reuse the KV cache of identical prompt prefixes across requests")
        group.add_argument("--num-threads", type=int, default=defaults.num_threads,
                           help="torch intra-op threads (default: the number of CPU cores)")
        group.add_argument("--kernels", default=defaults.kernels, choices=KERNEL_CHOICES,
                           help="native = ember's C kernels for bfloat16 on x86-64 CPUs with AVX-512 (paged decode "
                                "attention, fused RMSNorm/RoPE/SiLU; built once with the system C compiler into "
                                "~/.cache/ember) at the CPU's ISA level, torch = PyTorch ops only, auto = native "
                                "where it can run, amx/avx512_bf16/avx512/avx2 = the kernels of that ISA level "
                                "even where the CPU offers more (an error above the CPU's); default: "
                                "$EMBER_KERNELS or auto")
        group.add_argument("--quantization", default=defaults.quantization, choices=QUANTIZATION_CHOICES,
                           help="how the Linear layers' weights are held on CPU: none = float in --dtype (a GGUF "
                                "file's blocks dequantized at load); gguf = a .gguf file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/"
                                "Q4_K/Q5_K/Q6_K weights kept in their blocks and run by native kernels that "
                                "dequantize in registers; auto = with a .gguf file on CPU with native kernels, the blocks for "
                                "decode-sized batches (read at their 4.5-8.8 bits a weight) and for larger ones "
                                "the dequantized weights or, in bfloat16 on CPUs with AVX512-VNNI or AMX, int8 "
                                "copies run with int8 activations (W8A8; with AMX for decode steps of up to 64 "
                                "rows, prompts on the blocks); else none; "
                                "int8 = every weight quantized to int8 per output channel at load, from any "
                                "checkpoint (W8A8 past decode-sized batches on those CPUs) (default: %(default)s)")
        group.add_argument("--seed", type=int, default=defaults.seed,
                           help="seed of the global sampling generator (default: %(default)s)")
        group.add_argument("--speculative-config", default=None, metavar="JSON",
                           help="speculative decoding, as vLLM's flag: a JSON object such as "
                                '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 2}\'. ngram drafts the tokens that followed the latest '
                                "earlier occurrence of the sequence's last n tokens, and one step verifies them "
                                "all; outputs are those of plain decoding (same distribution when sampling). "
                                "Requests with penalties decode without drafts. Default: off")
        group.add_argument("--tensor-parallel-size", "-tp", type=int, default=defaults.tensor_parallel_size,
                           help="split every layer across this many ranks (processes; one per GPU on CUDA, "
                                "a group of cores or a socket on CPU); the attention heads must divide by it "
                                "(default: %(default)s)")
        group.add_argument("--cpu-bind", default=defaults.cpu_bind, metavar="CORES",
                           help="CPU cores of each tensor-parallel rank, '|'-separated as vLLM's "
                                "VLLM_CPU_OMP_THREADS_BIND: '0-31|32-63' (default: the available cores split "
                                "evenly)")
        group.add_argument("--tensor-parallel-all-reduce", default=defaults.tensor_parallel_all_reduce,
                           choices=TP_ALL_REDUCE_CHOICES,
                           help="how CPU ranks sum their partial results: shm = through shared memory (the "
                                "ranks run on this host), gloo = torch.distributed's gloo over loopback TCP; "
                                "CUDA always uses NCCL (default: %(default)s)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{field.name: getattr(ns, field.name) for field in dataclasses.fields(cls)})


def parse_cpu_bind(value: str) -> list[list[int]]:
    """"0-3,8|4-7" -> [[0, 1, 2, 3, 8], [4, 5, 6, 7]]: one core list per rank."""
    core_lists = []
    for rank_spec in value.split("|"):
        cores: list[int] = []
        for part in rank_spec.split(","):
            first, _, last = part.strip().partition("-")
            try:
                low, high = int(first), int(last or first)
            except ValueError:
                raise EmberError(f"cpu_bind {value!r}: {part.strip()!r} is not a core or a range of cores "
                                 "such as 0-3") from None
            if low < 0 or high < low:
                raise EmberError(f"cpu_bind {value!r}: bad core range {part.strip()!r}")
            cores += range(low, high + 1)
        core_lists.append(cores)
    return core_lists
