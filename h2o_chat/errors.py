"""The few exception types that h2o-chat reports to users.

Everything the CLI shows as "one clear line" derives from `H2OChatError`; any other exception is a bug.
"""

from __future__ import annotations


class H2OChatError(Exception):
    """Base class: the message is shown to the user as is, on one line."""

    exit_code = 2


class ConfigError(H2OChatError):
    """An impossible setting: a budget that cannot hold the recent window, an unknown policy, a bad file."""


class SettingError(ConfigError):
    """A setting's value that breaks its rule, said by the library without naming a front end's option: `name` is
    the library's keyword ("top_p"), `rule` what the value must be ("must be above 0 and at most 1"), `value` what
    was given. The message says it with the keyword; a front end says it with its own name for the setting
    (`worded`): the command line's --top-p, a request's "top_p"."""

    def __init__(self, name: str, rule: str, value, *, got: bool = True):
        self.name, self.rule, self.value, self.got = name, rule, value, got
        super().__init__(self.worded(name))

    def worded(self, label: str) -> str:
        """The message with `label` for the setting: "--top-p must be above 0 and at most 1, got 0"; a rule about
        the value itself names it first ("--decode graph needs a CUDA GPU ...")."""
        if not self.got:
            return f"{label} {self.value} {self.rule}"
        return f"{label} {self.rule}, got {_shown(self.value)}"


def _shown(value) -> str:
    """A value as an error shows it: 0.5 and 1e+09 for numbers, 'fast' quoted for text."""
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value) if isinstance(value, str) else str(value)


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
