"""A cache budget as the user types it, read in one place for --budget, /budget and --kv-memory.

Tokens (512) are the budget itself; a memory (64MB) is the most tokens whose keys and values fit in it, as the
cache stores them; a share (10%) is of a reference length: the model's trained context for the chat, a piped run
and batch (eval's shares are of its text or prompt, see measure/evaluate.py's BudgetSpec, which reads the
tokens and shares here too). No torch until a share or a count is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h2o_chat.errors import ConfigError, H2OChatError

if TYPE_CHECKING:
    from h2o_chat.measure.evaluate import BudgetSpec

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(name: str, text: str) -> int:
    """Bytes from '256MB', '1.5 GiB', '512k' or a plain number; K, M, G and T are powers of 1,024 (as the panel
    and every memory figure h2o-chat prints)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])i?b?|(b)?)\s*", text, re.IGNORECASE)
    if m is None:
        raise H2OChatError(f"{name} must be a size such as 256MB or 1.5GB, got {text!r}")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if size <= 0:
        raise H2OChatError(f"{name} must be more than 0 bytes, got {text!r}")
    return size


def tokens_in(flag: str, text: str, memory: int, per_token: int, rows: int = 1, kv_quant: str = "none") -> int:
    """The budget `memory` bytes hold (`flag` `text` as the user wrote it): the most tokens per row whose slots
    (keys, values, position, rotation and score: `per_token` bytes a row) fit for `rows` rows; an error when
    not one does."""
    tokens = memory // (per_token * rows)
    if tokens < 1:
        stored = " in 8 bits" if kv_quant == "8bit" else ""
        rows_words = f" for {rows} rows" if rows > 1 else ""
        raise H2OChatError(
            f"{flag} {text} holds no token: a token takes {per_token * rows:,} bytes in the cache{stored}{rows_words}"
        )
    return tokens


def within_context(tokens: int, context: int | None, head: str) -> tuple[int, str | None]:
    """A budget of at most the model's trained context, and a line saying why when `tokens` (`head` as the user
    wrote it) was more. Held tokens are numbered within the budget once the text passes the context (auto,
    rolling), or past the context (absolute): a budget above it only numbers tokens at positions the model never
    learned, and costs memory and time for nothing (-b 100000 on an 8,192-token model: 4.5 GB, 1.1 tok/s)."""
    if not context or tokens <= context:
        return tokens, None
    return context, (
        f"{head}: the budget is {context:,} tokens, the model's trained context: a larger cache would hold tokens "
        "at positions it was never trained on, and cost memory and time for nothing"
    )


@dataclass(frozen=True)
class BudgetText:
    """A budget as typed after `flag`: exactly one of tokens, memory (bytes) or share is set."""

    flag: str
    text: str
    tokens: int | None = None
    memory: int | None = None
    share: BudgetSpec | None = None

    @classmethod
    def parse(cls, flag: str, text: str) -> BudgetText:
        """Tokens (a whole number), a memory (a number and its unit, read as --kv-memory is) or a share (a
        percentage, read as eval reads it); one clear error otherwise."""
        m = re.fullmatch(r"\s*([-+]?[\d.]+)\s*(%|[a-z]+)?\s*", text, re.IGNORECASE)
        if m is None:
            raise ConfigError(
                f"{flag} takes a number of tokens (512), a memory (64MB) or a share of the trained context (10%), "
                f"got {text!r}"
            )
        number, unit = m.groups()
        if unit and unit != "%":
            return cls(flag, text, memory=parse_size(flag, text))
        if not unit and not re.fullmatch(r"[-+]?\d+", number):  # 2.5: not tokens, and bytes need their unit
            raise ConfigError(
                f"{flag} {text.strip()}: a number of tokens is a whole number, and a memory needs its unit "
                f"(e.g. {number}MB)"
            )
        from h2o_chat.measure.evaluate import BudgetSpec  # torch: only once a command runs, never for --help

        spec = BudgetSpec.parse(text)
        return cls(flag, text, share=spec) if spec.percent else cls(flag, text, tokens=int(spec.value))

    @classmethod
    def of_memory(cls, flag: str, text: str) -> BudgetText:
        """--kv-memory: a memory only (a plain number is bytes there)."""
        return cls(flag, text, memory=parse_size(flag, text))

    def resolve(
        self,
        per_token: Callable[[], int],
        context: Callable[[], int | None],
        rows: int = 1,
        kv_quant: str = "none",
    ) -> tuple[int, str | None]:
        """The budget in tokens, and a line saying how a memory or a share became that many (None for tokens).
        `per_token`: a token's key and value bytes per row, as `kv_quant` stores them (a memory is shared by
        `rows` rows); `context`: the model's trained context (a share's reference). Each is asked only if needed."""
        if self.tokens is not None:
            return self.tokens, None
        if self.memory is not None:
            each_bytes = per_token()
            tokens = tokens_in(self.flag, self.text, self.memory, each_bytes, rows, kv_quant)
            stored = " in 8 bits" if kv_quant == "8bit" else ""
            each = f" for each of {rows} rows" if rows > 1 else ""
            return tokens, f"{self.head}: a budget of {tokens:,} tokens{each} ({each_bytes:,} bytes a token{stored})"
        trained = context()
        if not trained:
            raise ConfigError(f"{self.head}: this model's trained context is not known; give the budget in tokens")
        tokens = self.share.tokens(trained)
        return tokens, f"{self.head}: a budget of {tokens:,} tokens ({self.share} of the trained context, {trained:,})"

    @property
    def head(self) -> str:
        return f"{self.flag} {self.text.strip()}"


@dataclass(frozen=True)
class StoreText:
    """--recall-memory as typed: exactly one of tokens, memory (bytes) or times (a multiple of the budget)."""

    text: str
    tokens: int | None = None
    memory: int | None = None
    times: float | None = None

    FLAG = "--recall-memory"

    @classmethod
    def parse(cls, text: str) -> StoreText:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*[xX]\s*", text)
        if m:
            times = float(m.group(1))
            if times <= 0:
                raise ConfigError(f"{cls.FLAG} {text.strip()}: a multiple of the budget must be above 0")
            return cls(text, times=times)
        if re.fullmatch(r"\s*\d+\s*", text):
            return cls(text, tokens=int(text))
        try:
            return cls(text, memory=parse_size(cls.FLAG, text))
        except H2OChatError:
            raise ConfigError(
                f"{cls.FLAG} takes a memory (64MB), evicted tokens per layer and head (4096) or a multiple of the "
                f"budget (8x), got {text!r}"
            ) from None

    def resolve(self, budget: int, sizes: Callable[[], tuple[int, int]], rows: int = 1) -> tuple[int, str | None]:
        """Tokens per row, layer and head for a budget of `budget`, and a line saying how a memory became that
        many (None otherwise). `sizes`: the bytes an evicted token takes in the store per row, and the store's
        fixed bytes per row (its basis, its spare entry): a memory holds the store whole."""
        if self.tokens is not None:
            return self.tokens, None
        if self.times is not None:
            return max(1, round(self.times * budget)), None
        each, fixed = sizes()
        tokens = (self.memory - fixed * rows) // (each * rows)
        if tokens < 1:
            raise ConfigError(f"{self.FLAG} {self.text.strip()} holds no token: one takes {each * rows:,} bytes")
        head = f"{self.FLAG} {self.text.strip()}"
        return tokens, f"{head}: {tokens:,} evicted tokens kept for recall ({each:,} bytes a token)"
