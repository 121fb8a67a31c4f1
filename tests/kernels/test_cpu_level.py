"""The ISA level and `--dtype auto` choice of each x86 family, from the flags its /proc/cpuinfo lists."""

from __future__ import annotations

import pytest

from ember.kernels.cpu import auto_cpu_dtype, compile_flags, isa_level

BASE = {"sse4_2", "avx", "f16c"}
HASWELL_TO_ZEN3 = BASE | {"avx2", "fma", "bmi2"}
ICE_LAKE = HASWELL_TO_ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni",
                              "avx512vbmi"}
COOPER_LAKE = ICE_LAKE | {"avx512_bf16"}
ZEN4 = ICE_LAKE | {"avx512_bf16", "avx512_vnni", "avx512_bitalg"}
SAPPHIRE_RAPIDS = COOPER_LAKE | {"amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"}


@pytest.mark.parametrize(("flags", "level", "dtype"), [
    (set(), "none", "float32"),
    (BASE, "none", "float32"),
    (BASE | {"avx2"}, "none", "float32"),  # AVX2 without FMA is not a level
    (HASWELL_TO_ZEN3, "avx2", "float32"),
    (ICE_LAKE, "avx512", "float32"),
    (ICE_LAKE - {"avx512bw"}, "avx2", "float32"),  # Knights Landing: AVX-512F without BW/VL
    (COOPER_LAKE, "avx512_bf16", "bfloat16"),
    (ZEN4, "avx512_bf16", "bfloat16"),
    (SAPPHIRE_RAPIDS, "amx", "bfloat16"),
    (SAPPHIRE_RAPIDS - {"avx512_bf16"}, "avx512", "float32"),  # each level needs the ones below it
])
def test_level_and_auto_dtype_per_cpu_family(flags: set[str], level: str, dtype: str) -> None:
    assert isa_level(flags) == level
    chosen, reason = auto_cpu_dtype(flags)
    assert chosen == dtype
    assert reason  # logged at start


def test_ice_lake_reason_names_the_emulation() -> None:
    assert auto_cpu_dtype(ICE_LAKE) == (
        "float32", "the CPU has AVX-512 without AVX512-BF16: bfloat16 would be emulated")


def test_compile_flags_per_level() -> None:
    assert compile_flags("amx", "amx") == ("-march=native",)
    assert compile_flags("avx2", "amx") == ("-march=x86-64-v3", "-mtune=native")
    assert compile_flags("avx512", "avx512_bf16") == ("-march=x86-64-v4", "-mtune=native")
    assert compile_flags("avx512_bf16", "amx") == ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native")
