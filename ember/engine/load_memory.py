"""How much memory loading a model's weights took in this process: the weights' bytes, and how far resident
memory peaked above its level before loading (Linux: /proc/self/status, whose peak clear_refs resets).

Logged by every rank, so an operator (and the tensor-parallel tests) can see that each rank materialized only
its slice of the checkpoint, and how much headroom a rank needs to load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_PEAK_RSS = "5"  # proc(5): writing 5 to clear_refs resets the peak resident set size (VmHWM)


@dataclass(frozen=True)
class LoadMemory:
    weight_bytes: int  # the module's parameters and buffers (a tied tensor once)
    peak_growth_bytes: int | None  # peak resident memory while loading, above the level before; None: unknown


def measure_load(model: nn.Module, load: Callable[[], None]) -> LoadMemory:
    """Run `load` (which fills `model`'s weights) and measure what it took."""
    try:
        before: int | None = _status_bytes("VmRSS")
        CLEAR_REFS.write_text(RESET_PEAK_RSS)
    except OSError:  # not Linux, or /proc read-only: the peak would include earlier work
        before = None
    load()
    peak = None if before is None else _status_bytes("VmHWM") - before
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    return LoadMemory(sum(t.numel() * t.element_size() for t in tensors.values()), peak)


def _status_bytes(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise OSError(f"{STATUS} has no {field}")
