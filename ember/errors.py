"""Errors shared across Ember's packages: those that carry a message meant for the user (the CLI prints
them without a traceback), and the HTTP servers' signal that a client went away."""


class EmberError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model."""


class ModelLoadError(EmberError):
    """The model could not be found or loaded (missing file, corrupt GGUF, unsupported architecture/quant)."""


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready (`ember serve` and the gateway): nothing is
    sent back."""
