"""The few exception types that h2o-chat reports to users.

Everything the CLI shows as "one clear line" derives from `H2OChatError`; any other exception is a bug.
"""

from __future__ import annotations


class H2OChatError(Exception):
    """Base class: the message is shown to the user as is, on one line."""

    exit_code = 2


class ConfigError(H2OChatError):
    """An impossible setting: a budget that cannot hold the recent window, an unknown policy, a bad file."""


class UnknownModelError(H2OChatError):
    """A model name that is neither an alias, a local path nor a Hugging Face repo id."""


class ModelNotFoundError(H2OChatError):
    """The model is known but its weights are not on this machine."""


class DeviceError(H2OChatError):
    """The requested device, dtype or quantization is not available here."""


class InputError(H2OChatError):
    """Bad user input: empty or undecodable stdin, a malformed line or file."""


class CacheUsageError(H2OChatError):
    """The H2O cache was used with a model whose attention does not go through h2o-chat's attention function."""


class ContextLimitError(H2OChatError):
    """The model cannot read past its trained context (learned absolute positions, e.g. OPT): `context` tokens.
    The engine says what happened; the chat adds what the user can do (`advice`)."""

    advice = "start a new conversation (/reset) or shorten the input"

    def __init__(self, context: int):
        self.context = context
        super().__init__(
            f"the model's learned positions end at {context} tokens (OPT): it cannot read or write past them, "
            "whatever the budget"
        )


class StdoutError(OSError):
    """Writing to stdout failed (a full disk, /dev/full, an I/O error), not the reader going away (EPIPE, which
    ends quietly): the CLI says so on one line and exits 1."""


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the device running out of memory: torch's OutOfMemoryError (CUDA), or the CPU
    allocator's "can't allocate" RuntimeError (named here without importing torch)."""
    if type(error).__name__ == "OutOfMemoryError":
        return True
    return isinstance(error, RuntimeError) and "can't allocate" in str(error)
