"""Errors that carry a message meant for the user (the CLI prints them without a traceback)."""


class EmberError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model."""


class ModelLoadError(EmberError):
    """The model could not be found or loaded (missing file, corrupt GGUF, unsupported architecture/quant)."""
