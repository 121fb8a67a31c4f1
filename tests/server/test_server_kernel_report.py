"""`ember serve` reports its dtype (and why), the code each part of a step runs on and its KV cache's format: in
its start log, in each /v1/models card's `ember` field and as `ember:kernel_path_info` and
`ember:cache_config_info` (vLLM's `vllm:cache_config_info`) on /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ember.kernels.build import compiler
from ember.kernels.cpu import cpu_isa_level, level_at_least
from ember.models.config import auto_cpu_dtype_choice
from tests.conftest import build_tiny_model_dir

TORCH_PATHS = {"gemm": "torch", "attention_decode": "torch", "attention_prefill": "torch", "fused_ops": "torch",
               "decoder_stack": "off"}
# A forced AVX-512 level: attention and fused ops native, the GEMMs (AMX or AVX512-BF16) and the stack not.
AVX512_PATHS = {"gemm": "torch", "attention_decode": "native_avx512", "attention_prefill": "native_avx512",
                "fused_ops": "native_avx512", "decoder_stack": "off"}


def kernel_path_samples(server) -> dict[str, float]:
    return {key: value for key, value in server.metrics().items() if key.startswith("ember:kernel_path_info")}


def test_float32_on_torch_ops_is_reported(server, auth) -> None:
    card = httpx.get(f"{server.url}/v1/models", headers=auth).json()["data"][0]
    assert card["ember"] == {"dtype": "float32", "dtype_reason": "set by --dtype float32", "kernel_level": "none",
                             "kernels": TORCH_PATHS, "kv_cache_dtype": "float32"}
    assert kernel_path_samples(server) == {
        f'ember:kernel_path_info{{model_name="tiny",part="{part}",path="{path}"}}': 1.0
        for part, path in TORCH_PATHS.items()
    }
    assert "kernel path: attention_decode = torch" in server.log()


@pytest.fixture(scope="module")
def native_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 32-wide heads, the narrowest the native attention takes."""
    if compiler() is None or not level_at_least(cpu_isa_level(), "avx512"):
        pytest.skip("the native kernels need a C compiler and AVX-512")
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-32"), num_attention_heads=2, num_key_value_heads=1)


def test_forced_avx512_level_is_reported(launch_server, native_model_dir: Path) -> None:
    server = launch_server(native_model_dir, "--dtype", "bfloat16", "--kernels", "avx512")
    try:
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert card["ember"] == {"dtype": "bfloat16", "dtype_reason": "set by --dtype bfloat16",
                                 "kernel_level": "avx512", "kernels": AVX512_PATHS, "kv_cache_dtype": "bfloat16"}
        assert kernel_path_samples(server) == {
            f'ember:kernel_path_info{{model_name="tiny",part="{part}",path="{path}"}}': 1.0
            for part, path in AVX512_PATHS.items()
        }
        completion = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
        log = server.log()
        assert "native, ISA level avx512" in log and "kernel path: fused_ops = native_avx512" in log
    finally:
        server.stop()


def test_auto_dtype_gives_its_reason(launch_server, native_model_dir: Path) -> None:
    server = launch_server(native_model_dir, "--dtype", "auto")
    try:
        ember = httpx.get(f"{server.url}/v1/models").json()["data"][0]["ember"]
    finally:
        server.stop()
    dtype, reason = auto_cpu_dtype_choice()
    assert (ember["dtype"], ember["dtype_reason"]) == (str(dtype).removeprefix("torch."), reason)
    assert f"dtype auto: {ember['dtype']}, as {reason}" in server.log()


def test_a_level_without_kernels_for_the_dtype_stops_the_start(launch_server, native_model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="native kernels cannot run here: the bfloat16 kernels need AVX-512 "
                       "and the ISA level is avx2"):
        launch_server(native_model_dir, "--dtype", "bfloat16", "--kernels", "avx2")


@pytest.mark.slow
def test_quantized_gguf_weights_are_reported_and_served(launch_server, smollm2_gguf_path: Path) -> None:
    if compiler() is None or not level_at_least(cpu_isa_level(), "avx2"):
        pytest.skip("quantized weights need a C compiler and AVX2")
    server = launch_server(smollm2_gguf_path, "--dtype", "float32", "--kernels", "avx2", "--quantization", "gguf")
    try:
        gemm = httpx.get(f"{server.url}/v1/models").json()["data"][0]["ember"]["kernels"]["gemm"]
        assert gemm == "native_quant_avx2 (q4_1+q8_0, avx2_maddubs; up to 16 rows, else dequantized + torch)"
        completion = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
        assert completion.status_code == 200 and "Paris" in completion.json()["choices"][0]["text"]
        assert f"kernel path: gemm = {gemm}" in server.log()
    finally:
        server.stop()


def test_gguf_quantization_of_a_folder_stops_the_start(launch_server, tiny_model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="is not a .gguf file; use --quantization int8"):
        launch_server(tiny_model_dir, "--quantization", "gguf")


def cache_config_samples(server) -> dict[str, float]:
    return {key: value for key, value in server.metrics().items() if "cache_config_info" in key}


def test_the_kv_cache_format_is_reported(server) -> None:
    samples = cache_config_samples(server)
    assert sorted(key.split("{")[0] for key in samples) == ["ember:cache_config_info", "vllm:cache_config_info"]
    assert set(samples.values()) == {1.0}
    labels = dict(item.split("=") for item in min(samples).split("{")[1].rstrip("}").split(","))
    assert int(labels.pop("num_gpu_blocks").strip('"')) > 0
    assert labels == {"block_size": '"16"', "cache_dtype": '"float32"', "enable_prefix_caching": '"True"'}


@pytest.mark.slow
def test_int8_kv_cache_on_the_default_model_is_reported_and_served(launch_server, smollm2_gguf_path: Path) -> None:
    """The default configuration (dtype, quantization and kernels auto) with --kv-cache-dtype int8, over HTTP."""
    server = launch_server(smollm2_gguf_path, "--dtype", "auto", "--kv-cache-dtype", "int8")
    try:
        ember = httpx.get(f"{server.url}/v1/models").json()["data"][0]["ember"]
        assert ember["kv_cache_dtype"] == "int8"
        assert all('cache_dtype="int8"' in key for key in cache_config_samples(server))
        completion = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
        assert completion.status_code == 200 and "Paris" in completion.json()["choices"][0]["text"]
        assert "KV blocks of 16 tokens in int8" in server.log()
    finally:
        server.stop()


def test_an_unknown_kv_cache_dtype_stops_the_start(launch_server, tiny_model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="--kv-cache-dtype: invalid choice: 'fp8'"):
        launch_server(tiny_model_dir, "--kv-cache-dtype", "fp8")
