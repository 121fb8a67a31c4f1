"""Building and choosing the native kernels: the cache, the fallbacks, the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.errors import EmberError
from ember.kernels.build import KernelBuildError, compiler, load_kernel
from ember.kernels.native import load_native_kernels

CPU = torch.device("cpu")


def test_float32_never_gets_native_kernels() -> None:
    assert load_native_kernels("auto", CPU, torch.float32, (576, 1536), 64, 3) is None
    with pytest.raises(EmberError, match="bfloat16"):
        load_native_kernels("native", CPU, torch.float32, (576, 1536), 64, 3)
    assert load_native_kernels("torch", CPU, torch.bfloat16, (576, 1536), 64, 3) is None


def test_head_dim_the_kernels_cannot_tile_falls_back() -> None:
    assert load_native_kernels("auto", CPU, torch.bfloat16, (64, 128), 16, 2) is None


def test_missing_compiler_is_a_build_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(KernelBuildError, match="no C compiler"):
        load_kernel.__wrapped__("fused_ops.c", ())


def test_build_is_cached_per_source_and_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if compiler() is None:
        pytest.skip("no C compiler")
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("the kernels are AVX-512 code: this CPU cannot compile them with -march=native")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    load_kernel.__wrapped__("paged_decode_attention.c", (("HEAD_DIM", 64), ("QUERIES_PER_KV", 3)))
    (built,) = (tmp_path / "kernels").glob("paged_decode_attention-*.so")
    stamp = built.stat().st_mtime_ns
    load_kernel.__wrapped__("paged_decode_attention.c", (("HEAD_DIM", 64), ("QUERIES_PER_KV", 3)))
    assert built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    load_kernel.__wrapped__("paged_decode_attention.c", (("HEAD_DIM", 128), ("QUERIES_PER_KV", 1)))
    assert len(list((tmp_path / "kernels").glob("paged_decode_attention-*.so"))) == 2
    assert not list((tmp_path / "kernels").glob("tmp*"))  # no partial builds left behind
