"""Multi-turn recall: is a fact the user gave early in a chat still there when a late question asks for it?

A conversation (`measure/dialogues.py`, seeded): the first turns state facts (a name, a number, a short
passkey, a dog's name), the next turns ask about passages of a shipped text, the last asks for one. It runs as the
chat runs it: each user turn, rendered with the chat template, is prefilled and appended to the cache (snap
compresses a turn that overflows the budget), each reply is fixed and teacher-forced through decode steps (every
policy sees the same conversation), then the answer is scored two ways:

- greedy hits: the fact's value appears in the greedy answer.
- likelihood: the NLL of the answer's value tokens ("Your locker number is| 4821|.") teacher-forced after the
  question, as the share of the full cache's gain that survives: (NLL without the fact - NLL) / (NLL without
  the fact - NLL full), "without the fact" being the same conversation with the asked fact's statement replaced
  by a neutral one, under the full cache. Summed over conversations before dividing (one conversation's gain
  can be near zero), with a bootstrap interval over conversations.

Every configuration is a row of one batch (conversations x configurations; each turn left-padded), in two
caches: the full cache (with and without the fact) and the budgeted policies. Budgets are a share of each
conversation's tokens (10% of a 1,200-token conversation: 120 per layer and head).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h2o_chat.engine.policies import STORE_MIN_TIMES, make_policy
from h2o_chat.engine.step.decode import DEFAULT_CHUNK, Engine, left_pad
from h2o_chat.engine.step.generate import stop_token_ids
from h2o_chat.measure.dialogues import Dialogue
from h2o_chat.measure.evaluate import BudgetSpec, Progress, Stopped, eval_engine, make_eval_cache

DEFAULT_POLICIES = ("h2o", "snap", "recall")


# -- running conversations through the cache -----------------------------------------------------------------
class _Meter:
    """Progress over the whole run in token-rows (a batch row reading or stepping one token): reading and
    decoding cost about the same per token-row, so the bar's rate and time left hold across caches."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def advance(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)

    def part(self, n: int) -> Progress:
        """A prefill's own (done, of) -- every pass over it (snap reads twice) -- mapped onto n token-rows."""
        if self.progress is None:
            return None
        start = self.done
        return lambda done, of: self.progress(min(start + done * n // max(1, of), self.total), self.total)


@dataclass
class _Scores:
    nll: list[float]  # per row: NLL of the answer's value tokens (summed)
    greedy: list[list[int]]  # per row: the greedy answer, cut before a stop token


@torch.inference_mode()
def _score(engine: Engine, logits: torch.Tensor, rows: Sequence[Dialogue], greedy_tokens: int, stops, meter):
    """From the state after the final question: teacher-force each row's answer (NLL of its value tokens), then
    go back to that state (`snapshot`/`restore`) and decode greedily."""
    cache, B = engine.cache, len(rows)
    first = logits.clone()
    saved = cache.snapshot()
    A = max(len(r.answer) for r in rows)
    answers = torch.tensor([r.answer + [r.answer[-1]] * (A - len(r.answer)) for r in rows], device=engine.device)
    nll = torch.zeros(B, A, device=engine.device)
    for j in range(A):
        nll[:, j] = F.cross_entropy(logits.float(), answers[:, j], reduction="none")
        if j < A - 1:
            logits = engine.decode(answers[:, j])[0].clone()
    meter.advance(B * (A - 1))
    cache.restore(saved)
    nll = nll.cpu()
    scored = [float(nll[i, r.scored[0] : r.scored[1]].sum()) for i, r in enumerate(rows)]
    tokens = first.argmax(-1)
    steps = [tokens]
    for _ in range(1, greedy_tokens):
        tokens = engine.decode(tokens)[1].clone()
        steps.append(tokens)
    meter.advance(B * (greedy_tokens - 1))
    out = torch.stack(steps, 1).tolist()
    cut = [next((row[:j] for j, t in enumerate(row) if t in stops), row) for row in out]
    return _Scores(scored, cut)


def _turn_by_turn(model, turns: list[list[list[int]]], replies, rows, policies, opts, meter) -> _Scores:
    """Rows (one policy each) read their user turns one by one, appending to the cache, with the fixed replies
    teacher-forced through decode steps in between -- the chat's path -- then the answer is scored."""
    cache = make_eval_cache(model, policies, positions=opts.positions, kv_quant=opts.kv_quant)
    columns = sum(max(len(row[t]) for row in turns) for t in range(len(turns[0])))  # left padding included
    columns += sum(map(len, replies[0])) + max(len(r.answer) for r in rows) + opts.greedy_tokens
    cache.reserve(columns)  # the full cache allocates once
    engine = eval_engine(model, cache, opts.decode)
    B = len(rows)
    logits = None
    for t in range(len(turns[0])):
        ids, mask = left_pad([row[t] for row in turns], opts.pad)
        logits = engine.prefill(ids, mask, opts.chunk_size, meter.part(B * ids.shape[1]))
        meter.advance(B * ids.shape[1])
        if t < len(replies[0]):
            reply = torch.tensor([r[t] for r in replies], device=engine.device)  # (B, K): `dialogues` cuts them alike
            for j in range(reply.shape[1]):
                logits = engine.decode(reply[:, j])[0]
            meter.advance(B * reply.shape[1])
    return _score(engine, logits, rows, opts.greedy_tokens, opts.stops, meter)


@dataclass(frozen=True)
class _Options:
    chunk_size: int
    positions: str
    decode: str
    greedy_tokens: int
    stops: frozenset
    pad: int
    kv_quant: str = "none"


@dataclass(frozen=True)
class RecallConfig:
    """A policy at a budget given as a share of each conversation (a per-row budget in tokens); for recall, its
    store: None (the policy's default), "all" (room for every token the conversation evicts) or a share of what
    it evicts ("25%")."""

    policy: str
    spec: BudgetSpec
    store: str | None = None

    def row_policy(self, tokens: int, **knobs):
        budget = self.spec.tokens(tokens)
        if self.policy != "recall" or self.store is None:
            return make_policy(self.policy, budget, **knobs)
        held = make_policy(self.policy, budget, **knobs)
        evicted = max(0, tokens - held.capacity)
        share = 1.0 if self.store == "all" else float(self.store.rstrip("%")) / 100
        store = max(STORE_MIN_TIMES * held.recalled, round(share * evicted))
        return make_policy(self.policy, budget, store=store, **knobs)


def recall(
    model,
    tokenizer,
    convs: Sequence[Dialogue],
    policies: Sequence[str],
    budgets: Sequence[BudgetSpec],
    *,
    greedy_tokens: int = 16,
    chunk_size: int = DEFAULT_CHUNK,
    positions: str = "absolute",
    group: int = 10,
    progress: Progress = None,
    decode: str = "auto",
    knobs: dict | None = None,
    kv_quant: str = "none",
    stores: Sequence[str | None] = (None,),
) -> list[dict]:
    """Run every conversation under the full cache (with and without the asked fact) and every (policy,
    budget[, recall's store: `stores`]), `group` conversations per batch; one record per configuration (see
    `summarise`)."""
    knobs = knobs or {}
    configs = [
        RecallConfig(p, b, s if p == "recall" else None)
        for p in dict.fromkeys(policies)
        if p != "full"
        for b in budgets
        for s in (stores if p == "recall" else (None,))
    ]
    opts = _Options(
        chunk_size, positions, decode, greedy_tokens, frozenset(stop_token_ids(tokenizer, model)),
        tokenizer.pad_token_id or 0, kv_quant,
    )  # fmt: skip
    steps = greedy_tokens + max(len(d.answer) for d in convs)
    work = sum(d.tokens + steps for d in convs) * (2 + len(configs))
    meter = _Meter(progress, work)
    full = make_policy("full")
    results: dict[str, list] = {"full": [], "without fact": [], **{_key(c): [] for c in configs}}
    t0 = time.perf_counter()
    done = 0  # conversations whose every configuration is scored
    try:
        for g in range(0, len(convs), group):
            _group(model, convs[g : g + group], configs, opts, meter, knobs, full, results)
            done = min(len(convs), g + group)
    except KeyboardInterrupt:
        if not done:
            raise
        kept = {key: got[:done] for key, got in results.items()}  # a group cut short is dropped
        records = summarise(tokenizer, convs[:done], configs, kept, time.perf_counter() - t0)
        raise Stopped(records, f"interrupted: {done} of {len(convs)} conversations done") from None
    seconds = time.perf_counter() - t0
    return summarise(tokenizer, convs, configs, results, seconds)


def _group(model, part, configs, opts, meter, knobs, full, results) -> None:
    """One batch of conversations: the full cache with and without the fact, then every configuration; their
    scores appended to `results`."""
    n = len(part)
    scores = _turn_by_turn(
        model,
        [d.turns for d in part] + [d.neutral_turns for d in part],
        [d.replies for d in part] * 2,
        list(part) * 2,
        [full] * (2 * n),
        opts,
        meter,
    )
    _collect(results["full"], part, scores, 0)
    _collect(results["without fact"], part, scores, n)
    if configs:
        row_policies = [c.row_policy(d.tokens, **knobs) for c in configs for d in part]
        scores = _turn_by_turn(
            model, [d.turns for d in part] * len(configs), [d.replies for d in part] * len(configs),
            list(part) * len(configs), row_policies, opts, meter,
        )  # fmt: skip
        for k, c in enumerate(configs):
            _collect(results[_key(c)], part, scores, k * n)


def _key(config: RecallConfig) -> str:
    store = f" store {config.store}" if config.store is not None else ""
    return f"{config.policy} {config.spec}{store}"


def _collect(into: list, part: Sequence[Dialogue], scores: _Scores, offset: int) -> None:
    for i in range(len(part)):
        into.append((scores.nll[offset + i], scores.greedy[offset + i]))


# -- summaries -----------------------------------------------------------------------------------------------
def hit(fact: str, answer: str) -> bool:
    """The fact's value appears in the answer (case and surrounding text aside)."""
    return fact.lower() in answer.lower()


def gain_kept(without: Sequence[float], full: Sequence[float], mine: Sequence[float]) -> float | None:
    """(sum NLL without the fact - sum NLL) / (sum NLL without the fact - sum NLL full); None when the full
    cache gains nothing (then no share of it can be kept)."""
    gain = sum(without) - sum(full)
    return (sum(without) - sum(mine)) / gain if gain > 0 else None


def bootstrap(without, full, mine, draws: int = 1000, seed: int = 0) -> tuple[float, float] | None:
    """A 90% interval of `gain_kept` over conversations resampled with replacement."""
    rng = random.Random(seed)
    n = len(mine)
    values = []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        v = gain_kept([without[i] for i in pick], [full[i] for i in pick], [mine[i] for i in pick])
        if v is not None:
            values.append(v)
    if not values:
        return None
    values.sort()
    return values[int(0.05 * len(values))], values[int(0.95 * len(values)) - 1]


def summarise(tokenizer, convs, configs, results: dict[str, list], seconds: float) -> list[dict]:
    """One record per configuration: greedy hits, mean NLL of the value tokens, the share of the full cache's
    gain kept (with a bootstrap interval), budgets in tokens (mean, min, max) and as a share, every answer."""
    without = [nll for nll, _ in results["without fact"]]
    full = [nll for nll, _ in results["full"]]
    full_answers = [tokenizer.decode(g, skip_special_tokens=True) for _, g in results["full"]]
    full_hits = sum(hit(d.fact, a) for d, a in zip(convs, full_answers, strict=True))
    mean_tokens = sum(d.tokens for d in convs) / len(convs)
    rows = [("full", None, "full"), ("without fact", None, "without fact")]
    rows += [(c.policy, c, _key(c)) for c in configs]
    records = []
    for policy, config, key in rows:
        got = results[key]
        nll = [v for v, _ in got]
        answers = [tokenizer.decode(g, skip_special_tokens=True) for _, g in got]
        hits = [hit(d.fact, a) for d, a in zip(convs, answers, strict=True)]
        budgets = [config.spec.tokens(d.tokens) for d in convs] if config else None
        kept = gain_kept(without, full, nll)
        interval = bootstrap(without, full, nll)
        records.append(
            {
                "policy": policy,
                "spec": str(config.spec) if config else None,
                "store": config.store if config else None,
                "budget": round(sum(budgets) / len(budgets)) if budgets else None,
                "budget_range": [min(budgets), max(budgets)] if budgets else None,
                "budget_pct": round(100 * sum(budgets) / len(budgets) / mean_tokens, 2) if budgets else None,
                "conversations": len(convs),
                "turns": len(convs[0].turns),
                "tokens": round(mean_tokens),
                "hits": sum(hits),
                "full_hits": full_hits,
                "hits_vs_full": round(sum(hits) / full_hits, 4) if full_hits else None,
                "nll": round(sum(nll) / len(nll), 4),
                "gain_kept": round(kept, 4) if kept is not None else None,
                "gain_kept_90": [round(v, 4) for v in interval] if interval else None,
                "seconds": round(seconds, 1),
                "answers": [
                    {
                        "kind": d.kind,
                        "fact": d.fact,
                        "fact_turn": d.fact_turn,
                        "answer": a,
                        "hit": h,
                        "nll": round(v, 4),
                    }
                    for d, a, h, v in zip(convs, answers, hits, nll, strict=True)
                ],
            }
        )
    return records
