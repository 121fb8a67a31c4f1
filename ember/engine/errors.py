"""The engine's typed errors, part of its public API: callers (the server, the offline LLM) tell a request
the engine refuses from an engine that failed or is gone by type, never by parsing messages.

InvalidRequestError subclasses ValueError and the runtime failures RuntimeError, so code that caught
those before keeps working."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The engine refuses this request as given; nothing was queued.

    `param` names the offending request field (OpenAI's `param`); `code` is a machine-readable kind, or
    None."""

    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class InvalidTokenIdError(InvalidRequestError):
    """A token id is not an integer in [0, vocabulary size)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room for a completion within max_model_len."""

    code = "context_length_exceeded"


class InvalidSamplingParamsError(InvalidRequestError):
    """A SamplingParams field is out of its range; `param` is the field's name."""


class EngineRequestError(EngineError, RuntimeError):
    """The engine failed while serving this request (a model step raised); the engine itself lives on."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine thread is not running (never started, shut down, or crashed)."""
