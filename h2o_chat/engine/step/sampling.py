"""Sampling on the device: temperature, top-k, top-p, min-p and a repetition penalty, with no host sync per token.

`Sampler` holds the settings (frozen, validated); `RowSampler` is its state for a batch of rows on the device:
per-row temperatures, penalties, top-k and min-p, a ring of each row's recent tokens for the penalty, and each
row's seed and count of draws.
Calling it on logits (B, V) is pure tensor work with static shapes, so it runs inside a captured decode step.

Randomness comes from a counter-based hash of (the row's seed, the row's draws so far, token id) instead of a
torch.Generator: the same seed gives the same text eagerly, compiled or replayed from a CUDA graph, on any device,
and nothing has to be registered with a graph. The noise belongs to the row, not to its slot in the batch: a row
samples as its prompt would alone, whichever rows beside it come and go. Sampling uses the exponential race:
argmax(p / E) with E ~ Exp(1) draws from p.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from dataclasses import dataclass, field

import torch

from h2o_chat.engine.storage.slots import mark_static
from h2o_chat.errors import SettingError

# tokens a repetition penalty looks back over: llama.cpp's and ollama's 64 let long stories loop (12 stories of
# 2,000 tokens: one looped, 9.6% of 4-grams repeated; at 256 none, 1.4%: docs/experiments.md)
PENALTY_WINDOW = 256
NUCLEUS_CAP = 512  # top-p and min-p choose among at most this many of the most likely tokens (top-k: its k)
MAX_TEMPERATURE = 10.0  # far past any useful setting: the distribution is flat noise well before
MAX_PENALTY = 10.0
_M32 = 0xFFFFFFFF
MAX_SEED = 0x7FFFFFFF  # seeds are 31 bits: a larger one is refused, not folded onto a smaller one's draws
_serials = itertools.count()  # names a RowSampler's tensors for the captured steps that read them (ids are reused)


@dataclass(frozen=True)
class Sampler:
    """temperature 0 = greedy; top_k > 0 keeps the k most likely tokens; top_p < 1 = nucleus sampling; min_p > 0
    drops tokens less likely than min_p times the most likely one; repetition_penalty > 1 makes the last
    `PENALTY_WINDOW` tokens less likely (divides positive logits, multiplies negative ones, as in CTRL and
    transformers); seed makes sampling repeatable. The filters apply together, as in llama.cpp."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    _auto_seed: int = field(default_factory=lambda: int.from_bytes(os.urandom(4), "little"), repr=False, compare=False)

    def __post_init__(self) -> None:
        """The one check of the sampling settings; each message says which value is wrong (NaN and infinity
        included: `not 0 <= x <= limit` is true for NaN)."""
        check_temperature(self.temperature)
        if not 0 < self.top_p <= 1:
            raise SettingError("top_p", "must be above 0 and at most 1", self.top_p)
        check_repetition_penalty(self.repetition_penalty)
        check_top_k(self.top_k)
        check_min_p(self.min_p)
        if self.seed is not None:
            check_seed(self.seed)

    def reseeded(self) -> Sampler:
        """The same settings with another draw: a fresh random seed, or the next seed after a given one (a
        retried reply should differ, and stay repeatable when a seed was given)."""
        if self.seed is not None:
            return dataclasses.replace(self, seed=(self.seed + 1) & MAX_SEED)
        return dataclasses.replace(self, _auto_seed=int.from_bytes(os.urandom(4), "little"))

    @property
    def effective_seed(self) -> int:
        return (self.seed if self.seed is not None else self._auto_seed) & MAX_SEED

    def for_batch(self, batch: int, device: torch.device, vocab: int, **overrides) -> RowSampler:
        """Device state for `batch` rows; `overrides` maps temperature / repetition_penalty / top_k / min_p /
        top_p to per-row lists, and seed to per-row seeds (None: the row takes this sampler's)."""
        per_row = {
            name: overrides.get(name) or [getattr(self, name)] * batch
            for name in ("temperature", "repetition_penalty", "top_k", "min_p", "top_p")
        }
        return RowSampler(
            per_row["temperature"],
            per_row["repetition_penalty"],
            per_row["top_p"],
            self.effective_seed,
            device,
            vocab,
            top_k=per_row["top_k"],
            min_p=per_row["min_p"],
            seeded=self.seed is not None,
            seeds=overrides.get("seed"),
        )


# the checks of single settings, shared by the Sampler and a batch line's own values (each front end words them)
def check_temperature(value: float) -> None:
    if not 0 <= value <= MAX_TEMPERATURE:
        raise SettingError("temperature", f"must be between 0 (greedy) and {MAX_TEMPERATURE:g}", value)


def check_repetition_penalty(value: float) -> None:
    if not 0 < value <= MAX_PENALTY:
        raise SettingError("repetition_penalty", f"must be above 0 and at most {MAX_PENALTY:g} (1 = off)", value)


def check_top_k(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingError("top_k", "must be a whole number >= 0 (0 = off)", value)


def check_min_p(value: float) -> None:
    if not 0 <= value < 1:
        raise SettingError("min_p", "must be at least 0 (off) and below 1", value)


def cuts(top_p: float, top_k: int, min_p: float) -> tuple[bool, bool]:
    """What one row's filters ask of a step's sampler (the part of `RowSampler.shape_key` a row decides): whether
    top-p cuts its candidates, and whether any filter (top-p, top-k, min-p) does. Rows alike in it share a step,
    each with its own values (batch's groups, the server's lanes)."""
    nucleus = top_p < 1.0
    return nucleus, bool(nucleus or top_k or min_p)


def check_seed(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise SettingError("seed", f"must be a whole number from 0 to {MAX_SEED}", value)


class RowSampler:
    """Sampling state for B rows on the device. `__call__(logits (B, V)) -> tokens (B,)`; `observe(ids, mask)`
    starts a prompt in every row, `start_row` in one. Which operations run is fixed at construction (graph-safe).

    Each row draws its noise from its own seed and its own count of draws, which move with the row when others
    leave (`select_rows`). With a seed given every row's seed is that seed, so a row gives the text its prompt
    gives alone with it; without one, rows take successive seeds drawn from the random one, so they differ. A
    row's own seed (`seeds`, `start_row`) and top-p (`top_p` a list, `set_row`) are those it would have alone:
    rows that differ in them share a step, as long as they agree on whether top-p cuts (`nucleus`)."""

    def __init__(
        self,
        temperatures,
        penalties,
        top_p: float | list[float],
        seed: int,
        device: torch.device,
        vocab: int,
        top_k=None,
        min_p=None,
        seeded: bool = True,
        seeds: list[int | None] | None = None,
    ):
        B = len(temperatures)
        top_k, min_p = top_k or [0] * B, min_p or [0.0] * B
        top_p = [float(top_p)] * B if isinstance(top_p, int | float) else [float(p) for p in top_p]
        self.device, self.vocab = device, vocab
        self.top_p = torch.tensor(top_p, dtype=torch.float32, device=device)  # (B,): a compiled step reads it
        self.temperature = torch.tensor(temperatures, dtype=torch.float32, device=device)  # (B,)
        self.penalty = torch.tensor(penalties, dtype=torch.float32, device=device)  # (B,)
        self.hot = any(t > 0 for t in temperatures)  # host-known: does any row sample?
        self.penalized = any(p != 1.0 for p in penalties)
        # host-known too: whether candidates are cut to the most likely ones, and how many a step ranks (top-p
        # and min-p look at NUCLEUS_CAP, top-k at its k); a row without top-k keeps them all (k = the cut)
        rows = [cuts(p, k, m) for p, k, m in zip(top_p, top_k, min_p, strict=True)]
        self.nucleus = any(n for n, _ in rows)  # host-known: whether top-p cuts (every row's: `set_row`)
        self.filtered = any(f for _, f in rows)
        self.cut = min(vocab, max(NUCLEUS_CAP, *top_k))
        self.top_k = torch.tensor([k or self.cut for k in top_k], dtype=torch.long, device=device)  # (B,)
        self.min_p = torch.tensor(min_p, dtype=torch.float32, device=device)  # (B,)
        # per row: a ring of its last tokens (the next draw writes slot draws % PENALTY_WINDOW, its oldest), how
        # many tokens it has drawn since its prompt, and its seed
        self.recent = torch.full((B, PENALTY_WINDOW), -1, dtype=torch.long, device=device)
        self.draws = torch.zeros(B, dtype=torch.long, device=device)
        self._seed, self._seeded, self._started = seed, seeded, 0
        own = seeds or [None] * B
        self.seeds = torch.tensor([self._seed_of(s) for s in own], dtype=torch.long, device=device)
        self.ids = torch.arange(vocab, device=device)
        self.rank = torch.arange(self.cut, device=device)
        self._static()

    def _static(self) -> None:
        """Fixed addresses: a captured step updates the window and the counters in place. A new serial names
        these tensors (a captured step is keyed on it, never on id(), which a later object may reuse)."""
        mark_static(*self._state())
        self.serial = next(_serials)

    # a row's own tensors (indexed by row first), then those every row shares
    PER_ROW = ("temperature", "penalty", "top_p", "top_k", "min_p", "recent", "draws", "seeds")
    STATE = (*PER_ROW, "ids", "rank")

    def _state(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.STATE)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a draw reads, by name (a compiled step's inputs)."""
        return {name: getattr(self, name) for name in self.STATE}

    def with_tensors(self, replaced: dict[str, torch.Tensor]) -> RowSampler:
        """The same sampler reading `replaced` tensors instead (a traced step reads its inputs through it)."""
        other = copy.copy(self)
        for name, t in replaced.items():
            setattr(other, name, t)
        return other

    def _next_seed(self) -> int:
        """The seed of the next row to start a prompt: the given seed, or the next of a sequence from the random
        one (host arithmetic; the hash mixes it on the device)."""
        k, self._started = self._started, self._started + 1
        return self._seed if self._seeded else (self._seed + k * 0x9E3779B9) & MAX_SEED

    def _seed_of(self, own: int | None) -> int:
        """A starting row's seed: its own (masked as `Sampler.effective_seed` masks one), else the next one."""
        return self._next_seed() if own is None else own & MAX_SEED

    @property
    def shape_key(self) -> tuple:
        """What decides which operations a step runs: samplers with equal keys can share a captured step."""
        return (self.batch, self.hot, self.penalized, self.nucleus, self.filtered, self.cut)

    def load(self, other: RowSampler) -> None:
        """Become `other` in place (same shape key): a captured step keeps reading these tensors."""
        for mine, theirs in zip(self._state(), other._state(), strict=True):
            mine.copy_(theirs)
        self._seed, self._seeded, self._started = other._seed, other._seeded, other._started

    def set_row(
        self,
        r: int,
        temperature: float,
        penalty: float,
        top_k: int = 0,
        min_p: float = 0.0,
        top_p: float | None = None,
    ) -> None:
        """Row r's settings, in place (a new prompt takes the row; the step's shape key must allow them: a top-p
        below 1 needs a sampler whose top-p cuts, and 1 one whose top-p does not, as the row alone would)."""
        if top_p is not None and (top_p < 1.0) != self.nucleus:
            raise ValueError(f"top_p {top_p} in a sampler whose top-p {'cuts' if self.nucleus else 'does not cut'}")
        self.temperature[r], self.penalty[r] = temperature, penalty
        self.top_k[r], self.min_p[r] = top_k or self.cut, min_p
        if top_p is not None:
            self.top_p[r] = top_p

    def start_row(self, r: int, ids: torch.Tensor, seed: int | None = None, history: list[int] | None = None) -> None:
        """A new prompt (1, L) takes row r (continuous batching): the row gets its own `seed`, else the seed of a
        row that starts, and its draws start again, so it samples as the prompt would alone; its penalty window
        is the tail of `history` (the tokens its cache read before, a conversation's earlier turns) and the
        prompt."""
        self.seeds[r] = self._seed_of(seed)
        self.draws[r] = 0
        if not self.penalized:
            return
        tail = _with_history(ids.reshape(1, -1), history)[0, -PENALTY_WINDOW:]
        self.recent[r].fill_(-1)
        self.recent[r, PENALTY_WINDOW - tail.numel() :] = tail.to(self.device)  # ends at the last slot

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]

    def observe(self, ids: torch.Tensor, mask: torch.Tensor | None = None, history: list[int] | None = None) -> None:
        """A (left-padded) prompt (B, L) in every row: the rows' draws start again, and their last real tokens
        fill the penalty window, ending at its last slot (a row's first draw then replaces the oldest). `history`:
        the tokens every row's cache read before the prompt (a conversation's earlier turns), which the window
        sees first, as it would had the whole conversation been the prompt."""
        self.draws.zero_()
        if not self.penalized:
            return
        if mask is not None:
            ids = ids.masked_fill(mask == 0, -1)
        ids = _with_history(ids, history)
        tail = ids[:, -PENALTY_WINDOW:]
        self.recent.fill_(-1)
        self.recent[:, PENALTY_WINDOW - tail.shape[1] :] = tail

    def select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        for name in self.PER_ROW:
            setattr(self, name, getattr(self, name)[index])
        self._static()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) tokens; records them for the penalty and counts a draw in every row."""
        tokens = self._draw(logits)
        if self.penalized:
            self.recent.scatter_(1, (self.draws % PENALTY_WINDOW)[:, None], tokens[:, None])
        self.draws.add_(1)  # in place, no attribute stored: a compiled step keeps no state of its own
        return tokens

    def _draw(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.penalized:
            logits = self._penalize(logits)
        tokens = logits.argmax(dim=-1)
        if self.hot:
            tokens = torch.where(self.temperature > 0, self._sample(logits), tokens)
        return tokens

    def first_of_row(self, r: int, logits: torch.Tensor) -> torch.Tensor:
        """Row r's first token from its new prompt's logits (V,), drawn with the row's settings and noise, and
        counted as its draw (the next step's noise is the row's next); the other rows' state is untouched."""
        token = self._row(r)._draw(logits.reshape(1, -1))[0]  # row r alone: 1/B of the work, the same draw
        if self.penalized:
            self.recent[r].scatter_(0, (self.draws[r] % PENALTY_WINDOW).reshape(1), token.reshape(1))
        self.draws[r] += 1
        return token

    def _row(self, r: int) -> RowSampler:
        """Row r as a sampler of one row, reading views of this one's tensors (each row draws alone: its own
        settings, window, seed and count of draws)."""
        return self.with_tensors({name: getattr(self, name)[r : r + 1] for name in self.PER_ROW})

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalize the window's tokens only (B, W values, not the vocabulary): empty entries point at an extra
        column that is dropped; a token that is in the window twice gets the same value twice."""
        ids = torch.where(self.recent >= 0, self.recent, self.vocab)  # (B, W)
        padded = torch.nn.functional.pad(logits, (0, 1))  # (B, V + 1)
        seen = padded.gather(1, ids)
        p = self.penalty[:, None]
        padded.scatter_(1, ids, torch.where(seen > 0, seen / p, seen * p))
        return padded[:, : self.vocab]

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        probs = (logits / self.temperature.clamp(min=1e-6)[:, None]).softmax(dim=-1)  # (B, V)
        if not self.filtered:  # argmax of p / E, E ~ Exp(1), is a draw from p
            return (probs / self._exponential(self.ids[None, :])).argmax(dim=-1)
        # candidates among the `cut` most likely tokens (a full sort of the vocabulary costs more than the rest
        # of sampling; llama.cpp and ollama cut to 40 before top-p); each filter masks, no shape depends on it
        top, ids = probs.topk(self.rank.shape[0], dim=-1)  # (B, cut), descending (a compiled step: symbolic)
        outside = self.rank[None, :] >= self.top_k[:, None]  # top-k (a row without it keeps the cut)
        outside |= top < self.min_p[:, None] * top[:, :1]  # min-p: relative to the most likely token
        if self.nucleus:
            outside |= top.cumsum(-1) - top >= self.top_p[:, None]  # the smallest set whose mass reaches top_p
        race = (top / self._exponential(ids)).masked_fill(outside, -1.0)
        return ids.gather(-1, race.argmax(dim=-1, keepdim=True)).squeeze(-1)

    def _exponential(self, ids: torch.Tensor) -> torch.Tensor:
        """Exp(1) noise for token ids (B or 1, k) from a hash of (the row's seed, its draws, token id):
        reproducible and graph-safe, the same for a token wherever it ranks."""
        base = _hash32((_hash32(self.seeds) + self.draws * 0x9E3779B1) & _M32)  # (B,)
        x = _hash32((base[:, None] + ids * 0x27D4EB2D) & _M32)  # (B, k)
        u = ((x >> 8).float() + 0.5) / float(1 << 24)  # uniform in (0, 1), 24 bits: never 0 or 1
        return -torch.log(u)


def draw(sampler: RowSampler | None, logits: torch.Tensor) -> torch.Tensor:
    """Tokens (B,) from logits (B, V): the sampler's draw, or the most likely (None: greedy). Every step draws
    here, eager, compiled or captured, and so do a prompt's first tokens."""
    return sampler(logits) if sampler is not None else logits.argmax(dim=-1)


def _with_history(ids: torch.Tensor, history: list[int] | None) -> torch.Tensor:
    """(B, L) ids after the last `PENALTY_WINDOW` tokens of `history` (the same for every row), for the window."""
    if not history:
        return ids
    before = torch.tensor(history[-PENALTY_WINDOW:], dtype=ids.dtype, device=ids.device)
    return torch.cat([before.expand(ids.shape[0], -1), ids], dim=1)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Mueller's hash) in int64 arithmetic; inputs and outputs are < 2**32."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x
