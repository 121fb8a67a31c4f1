"""Building and choosing the native kernels: the cache, the fallbacks, the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.engine.args import EngineArgs
from ember.errors import EmberError
from ember.kernels.build import KernelBuildError, compiler, load_kernel
from ember.kernels.cpu import ISA_LEVELS, cpu_isa_level, level_at_least
from ember.kernels.native import load_native_kernels

CPU = torch.device("cpu")


def test_dtypes_without_kernels_fall_back() -> None:
    # float32 has native kernels since issue 14 (tests/kernels/test_float32_kernels.py); float16 has none.
    assert load_native_kernels("auto", CPU, torch.float16, (576, 1536), 64, 3) is None
    with pytest.raises(EmberError, match="they are bfloat16 and float32 kernels and the dtype is torch.float16"):
        load_native_kernels("native", CPU, torch.float16, (576, 1536), 64, 3)
    assert load_native_kernels("torch", CPU, torch.bfloat16, (576, 1536), 64, 3) is None


def test_head_dim_the_kernels_cannot_tile_falls_back() -> None:
    assert load_native_kernels("auto", CPU, torch.bfloat16, (64, 128), 16, 2) is None


def test_missing_compiler_is_a_build_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(KernelBuildError, match="no C compiler"):
        load_kernel.__wrapped__("fused_ops.c", (), "avx512")


def test_build_is_cached_per_source_and_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if compiler() is None:
        pytest.skip("no C compiler")
    if not level_at_least(cpu_isa_level(), "avx512"):
        pytest.skip("the kernels are AVX-512 code: this CPU cannot compile them")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    load_kernel.__wrapped__("paged_attention.c", (("HEAD_DIM", 64), ("QUERIES_PER_KV", 3)), "avx512")
    (built,) = (tmp_path / "kernels").glob("paged_attention-*.so")
    stamp = built.stat().st_mtime_ns
    load_kernel.__wrapped__("paged_attention.c", (("HEAD_DIM", 64), ("QUERIES_PER_KV", 3)), "avx512")
    assert built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    load_kernel.__wrapped__("paged_attention.c", (("HEAD_DIM", 128), ("QUERIES_PER_KV", 1)), "avx512")
    assert len(list((tmp_path / "kernels").glob("paged_attention-*.so"))) == 2
    assert not list((tmp_path / "kernels").glob("tmp*"))  # no partial builds left behind
    if cpu_isa_level() != "avx512":  # the CPU's own level builds with -march=native, a lower one with its own
        load_kernel.__wrapped__("paged_attention.c", (("HEAD_DIM", 64), ("QUERIES_PER_KV", 3)), cpu_isa_level())
        assert len(list((tmp_path / "kernels").glob("paged_attention-*.so"))) == 3


def test_forced_level_above_the_cpu_is_an_error() -> None:
    above = [level for level in ISA_LEVELS if not level_at_least(cpu_isa_level(), level)]
    if not above:
        pytest.skip("this CPU has every level")
    with pytest.raises(EmberError, match=f"--kernels {above[0]} needs a CPU with {above[0]}"):
        load_native_kernels(above[0], CPU, torch.bfloat16, (576, 1536), 64, 3)
    with pytest.raises(EmberError, match=f"--kernels {above[0]} needs a CPU with {above[0]}"):
        EngineArgs(kernels=above[0])


def test_forced_lower_level_drops_the_kernels_it_lacks() -> None:
    if not level_at_least(cpu_isa_level(), "avx512") or compiler() is None:
        pytest.skip("no AVX-512 or no C compiler")
    kernels = load_native_kernels("avx512", CPU, torch.bfloat16, (576, 1536), 64, 3)
    assert kernels.level == "avx512"
    assert kernels.gemm_name is None and not kernels.has_decoder_stack
    assert kernels.prefill_isa == "avx512"  # prompt chunks row by row on vectors, not on AMX tiles
    with pytest.raises(EmberError, match="the bfloat16 kernels need AVX-512 and the ISA level is avx2"):
        load_native_kernels("avx2", CPU, torch.bfloat16, (576, 1536), 64, 3)


def test_kernels_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineArgs().kernels == "auto"
    monkeypatch.setenv("EMBER_KERNELS", "torch")
    assert EngineArgs().kernels == "torch"
    monkeypatch.setenv("EMBER_KERNELS", "sse9")
    with pytest.raises(EmberError, match="kernels must be one of auto, native, torch, amx, avx512_bf16, avx512, "
                       "avx2, got 'sse9'"):
        EngineArgs()
