"""Compile a kernel's C source into a shared library once and load it (see the package docstring)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ember.kernels.cpu import compile_flags, cpu_isa_level

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
COMPILE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm")


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember"
    )
    return Path(root) / "kernels"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def bind(library: ctypes.CDLL, name: str, *argtypes: type) -> ctypes._CFuncPtr:
    """`library`'s function `name`, taking `argtypes` and returning nothing (every ember kernel writes its
    results into buffers it is given)."""
    function = getattr(library, name)
    function.argtypes = list(argtypes)
    function.restype = None
    return function


@functools.cache
def load_kernel(source_name: str, defines: tuple[tuple[str, int], ...], level: str) -> ctypes.CDLL:
    """The library built from SOURCE_DIR/source_name with -D<name>=<value> for each of `defines`, for the ISA
    `level` (ember/kernels/cpu.py; at most this CPU's).

    Raises KernelBuildError when there is no compiler, the build fails or the library cannot be loaded."""
    try:
        return _build_and_load(source_name, defines, compile_flags(level, cpu_isa_level()))
    except OSError as exc:  # unwritable cache, missing compiler pieces, a library the loader refuses
        raise KernelBuildError(f"{source_name}: {exc}") from exc


def _build_and_load(source_name: str, defines: tuple[tuple[str, int], ...], isa_flags: tuple[str, ...]
                    ) -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    source = SOURCE_DIR / source_name
    flags = [*COMPILE_FLAGS, *isa_flags, *(f"-D{name}={value}" for name, value in defines)]
    key = hashlib.sha256()
    # Every source of the folder: a kernel includes headers and may include other kernels (decoder_stack.c).
    sources = [path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.[ch]"))]
    for part in (source.name.encode(), *sources, " ".join(flags).encode(), _compiler_identity(cc), _cpu_identity()):
        key.update(part)
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written library.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([cc, *flags, str(source), "-o", partial], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(partial)
            raise KernelBuildError(f"{cc} failed to build {source_name}:\n{result.stderr[-2000:]}")
        os.replace(partial, target)
        logger.info("built native kernel %s", target)
    return ctypes.CDLL(str(target))


@functools.cache  # once per process, not once per kernel
def _compiler_identity(cc: str) -> bytes:
    return subprocess.run([cc, "--version"], capture_output=True).stdout


@functools.cache
def _cpu_identity() -> bytes:
    # -march=native and -mtune=native build for this CPU: a cache shared by different machines must not mix their builds.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))})).encode()
