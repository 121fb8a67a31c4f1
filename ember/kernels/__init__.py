"""Native CPU kernels, compiled at run time for the model being served.

A kernel is one C file next to this module, built once per (source, shape constants, compiler, CPU) with the
system's C compiler (-O3 -fopenmp, -march for the ISA level chosen, see cpu.py) into the user cache, and called through ctypes on torch
tensors' memory. Building at run time keeps the package pure Python and lets the compiler target the exact
CPU; where no compiler or no suitable CPU exists, callers fall back to their PyTorch path."""

from ember.kernels.cpu import ISA_LEVELS

# --kernels values; here rather than in native.py so that building the CLI parser does not import torch. An
# ISA level forces the kernels built for that level even on a CPU that offers more (tests run each path).
KERNEL_CHOICES = ("auto", "native", "torch", *reversed(ISA_LEVELS[1:]))
