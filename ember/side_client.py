"""The HTTP client for side traffic: the gateway's health probes and /metrics scrapes, webhook
deliveries, and `ember up`'s readiness polls. One library (httpx) and one set of defaults for all of
it; the proxied requests themselves go through the lean client in ember/gateway/http_client.py.

Side traffic never follows redirects and ignores the environment's HTTP(S)_PROXY and .netrc: a probe
must reach the replica it names, and a webhook the address the SSRF guard checked."""

from __future__ import annotations

import httpx


def side_client(timeout_s: float, *, connect_s: float | None = None) -> httpx.AsyncClient:
    """A client whose requests give up after `timeout_s` waiting to connect, to send or for more of the
    response (`connect_s`, when given, bounds connecting instead). A request may pass its own `timeout=`."""
    timeout = httpx.Timeout(timeout_s) if connect_s is None else httpx.Timeout(timeout_s, connect=connect_s)
    return httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False)
