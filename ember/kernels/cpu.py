"""What this x86-64 CPU computes natively, as one ISA level, and the dtype `--dtype auto` picks from it.

The levels, from least to most capable (each includes the ones before it):
- "none": no AVX2+FMA (or not x86-64): ember's native kernels do not run.
- "avx2": AVX2 and FMA (Haswell to Coffee Lake desktops, AMD Zen 1-3).
- "avx512": AVX-512 F, BW and VL (Skylake-SP to Ice Lake servers).
- "avx512_bf16": AVX512-BF16 as well (Cooper Lake, AMD Zen 4/5).
- "amx": AMX tiles with bfloat16 and int8 (Sapphire/Emerald/Granite Rapids).

Read from /proc/cpuinfo's flags rather than torch, whose bfloat16 check only looks for AVX-512; the functions
take the flags as an argument so that every family can be tested on any machine. Imports no torch: the CLI
parser reads the levels."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

ISA_LEVELS = ("none", "avx2", "avx512", "avx512_bf16", "amx")
_LEVEL_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_bf16", "amx_int8", "amx_tile"},
}
# The compiler flags of each level below the CPU's own (that one is built with -march=native): the
# x86-64 micro-architecture level the ISA needs, plus the extensions the kernels use, tuned for this CPU.
_LEVEL_COMPILE_FLAGS = {
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    "amx": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}


def isa_level(flags: frozenset[str] | set[str]) -> str:
    """The highest level whose flags (and every lower level's) are all in `flags`."""
    level = "none"
    for candidate in ISA_LEVELS[1:]:
        if not _LEVEL_FLAGS[candidate] <= flags:
            break
        level = candidate
    return level


def level_at_least(level: str, minimum: str) -> bool:
    return ISA_LEVELS.index(level) >= ISA_LEVELS.index(minimum)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags from /proc/cpuinfo; empty where there is none or the machine is not x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_isa_level() -> str:
    return isa_level(cpu_flags())


def compile_flags(level: str, cpu_level: str) -> tuple[str, ...]:
    """The -march/-m flags that build a kernel for `level` on a CPU of `cpu_level` (at least `level`)."""
    if level == cpu_level:
        return ("-march=native",)
    return (*_LEVEL_COMPILE_FLAGS[level], "-mtune=native")


def auto_cpu_dtype(flags: frozenset[str] | set[str]) -> tuple[str, str]:
    """("bfloat16" or "float32", why) for `--dtype auto` on a CPU with `flags`: bfloat16 only where the CPU
    computes it natively (AVX512-BF16 or AMX); elsewhere PyTorch and oneDNN emulate it, slower than float32."""
    level = isa_level(flags)
    if level == "amx":
        return "bfloat16", "the CPU has AMX (native bfloat16 tiles)"
    if level == "avx512_bf16":
        return "bfloat16", "the CPU has AVX512-BF16 (native bfloat16 dot products)"
    if level == "avx512":
        return "float32", "the CPU has AVX-512 without AVX512-BF16: bfloat16 would be emulated"
    return "float32", f"the CPU has no native bfloat16 (ISA level {level})"


def kernel_level(setting: str, cpu_level: str) -> str:
    """The level `--kernels setting` builds the native kernels for: the CPU's own for auto and native, else
    the forced level, which must not exceed the CPU's ("torch" has none: "none")."""
    if setting == "torch":
        return "none"
    if setting in ("auto", "native"):
        return cpu_level
    if not level_at_least(cpu_level, setting):
        raise ValueError(f"--kernels {setting} needs a CPU with {setting}, but this CPU's level is {cpu_level} "
                         f"(levels: {', '.join(ISA_LEVELS[1:])})")
    return setting
