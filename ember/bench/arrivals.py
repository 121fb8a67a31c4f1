"""When each request is sent: all at once, or a gamma process at a target rate (vLLM's semantics)."""

from __future__ import annotations

import math

import numpy as np

from ember.errors import EmberError


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is issued.

    `request_rate` inf sends everything at once (then only --max-concurrency paces the run). Otherwise the
    gaps are gamma-distributed with mean 1/rate and shape `burstiness`: 1 is a Poisson process, lower is
    burstier, higher is more regular."""
    if not request_rate > 0:
        raise EmberError(f"--request-rate must be positive or inf, got {request_rate}")
    if not burstiness > 0:
        raise EmberError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    # The first request goes out at once; each later one waits its gap after the previous one.
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:num_requests]
