"""Bounded admission: how many requests (and prompt tokens) may wait for the engine at once.

A request counts as queued from admission until the engine produces its first output. Past either
cap the server answers 429 with Retry-After at once, instead of letting latency grow without bound.
Runs only on the event loop, so plain integers need no lock."""

from __future__ import annotations

from ember.server.errors import APIError


class AdmissionTicket:
    """One admitted request's claim on the queue; `started()` when the engine begins it,
    `release()` when it ends (both idempotent)."""

    __slots__ = ("_controller", "_num_requests", "_num_tokens", "_queued")

    def __init__(self, controller: AdmissionController, num_requests: int, num_tokens: int) -> None:
        self._controller = controller
        self._num_requests = num_requests
        self._num_tokens = num_tokens
        self._queued = True

    def started(self) -> None:
        if self._queued:
            self._queued = False
            self._controller.queued_requests -= self._num_requests
            self._controller.queued_tokens -= self._num_tokens

    def release(self) -> None:
        self.started()


class AdmissionController:
    def __init__(
        self,
        max_queued_requests: int | None = None,
        max_queued_tokens: int | None = None,
        retry_after_s: int = 1,
    ) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.queued_requests = 0
        self.queued_tokens = 0

    def admit(self, num_requests: int, num_tokens: int) -> AdmissionTicket:
        """Admit `num_requests` engine requests holding `num_tokens` prompt tokens, or raise 429."""
        # An empty queue takes any request, so one batch or prompt above a cap is not refused forever.
        if self.queued_requests > 0:
            if self.max_queued_requests is not None and (
                self.queued_requests + num_requests > self.max_queued_requests
            ):
                self._reject(f"{self.queued_requests} requests waiting, limit {self.max_queued_requests}")
            if (
                self.max_queued_tokens is not None
                and self.queued_tokens + num_tokens > self.max_queued_tokens
            ):
                self._reject(f"{self.queued_tokens} prompt tokens waiting, limit {self.max_queued_tokens}")
        self.queued_requests += num_requests
        self.queued_tokens += num_tokens
        return AdmissionTicket(self, num_requests, num_tokens)

    def _reject(self, message: str) -> None:
        raise APIError(
            429,
            f"Too many requests: the server queue is full ({message}); retry later",
            code="queue_full",
            headers={"Retry-After": str(self.retry_after_s)},
        )
