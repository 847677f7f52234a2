"""Quality evaluation: what a cache budget costs, measured through the same cache and decode steps as the chat.

- perplexity: teacher-forced, token by token (the text's first token is the only prefill, then one
  engine decode step per token), every (policy, budget) as a row of one `H2OCache` (rows follow their own
  policies): decoding cost is dominated by reading the weights, so all configurations read the text together
  for little more than one.
- needle: a 4-digit code hidden at several depths of a long text and asked for at the end (exact match).
- agreement: ROUGE-L F1 (LCS over token ids) of each configuration's greedy continuation against the full
  cache's.

Budgets are tokens per layer and KV head, typed as tokens ("256") or as a share of the reference length
("20%": of the text for perplexity, of the longest prompt for needle and agreement). Every cache here comes
from `make_eval_cache`, so cache options (e.g. how positions are assigned) live in one place, and every engine
from `eval_engine`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import Policy, make_policy
from h2o_chat.engine.step.attention import cache_keyword
from h2o_chat.engine.step.decode import DEFAULT_CHUNK, Engine, left_pad
from h2o_chat.engine.step.generate import stop_token_ids
from h2o_chat.errors import ConfigError, InputError
from h2o_chat.files import read_user_text

SHIPPED = ("alice.txt", "moby_dick.txt")
DEFAULT_POLICIES = ("h2o", "snap", "sink", "recent")  # the paper, our default, and the baselines
Progress = Callable[[int, int], None] | None  # progress(tokens done, tokens total)


class Stopped(KeyboardInterrupt):
    """Ctrl-C in a measurement whose records summarise all its units (recall's conversations): `records`
    summarise the units finished before it, `note` says how many ("interrupted: 2 of 30 conversations done")."""

    def __init__(self, records: list[dict], note: str):
        super().__init__(note)
        self.records, self.note = records, note


def eval_engine(model, cache: H2OCache, decode: str) -> Engine:
    """An engine for a measurement. A CPU step whose compiled package is not built yet runs eagerly while the
    model's `step_builder` (the command's `builder_for`, where it set one) builds it in a process of its own:
    an evaluation then runs compiled from the build's end, not eager to its own end."""
    engine = Engine(model, cache, decode)
    engine.builder = getattr(model, "step_builder", None)
    return engine


def _prompt_part(progress: Progress, prompt: int, total: int) -> Progress:
    """A prefill's progress mapped onto a loop's own tokens: reading the prompt covers its first `prompt` of
    `total` tokens, however many passes the policy makes (snap reads twice)."""
    if progress is None:
        return None
    return lambda done, of: progress(done * prompt // max(1, of), total)


# -- budgets and configurations ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetSpec:
    """A budget as the user typed it: a number of tokens, or a percentage of the reference length."""

    value: float
    percent: bool

    @classmethod
    def parse(cls, text: str) -> BudgetSpec:
        s = text.strip()
        percent = s.endswith("%")
        try:
            value = float(s[:-1]) if percent else int(s)
        except ValueError:
            raise ConfigError(
                f"budget must be a number of tokens (e.g. 256) or a percentage (e.g. 20%), got {text!r}"
            ) from None
        if percent and not 0 < value <= 100:
            raise ConfigError(f"a percentage budget must be above 0% and at most 100%, got {text!r}")
        if not percent and value <= 0:
            raise ConfigError(f"budget must be a positive number of tokens, got {text!r}")
        return cls(value, percent)

    def tokens(self, n: int) -> int:
        return max(1, round(self.value * n / 100)) if self.percent else int(self.value)

    def __str__(self) -> str:
        return f"{self.value:g}%" if self.percent else str(int(self.value))


@dataclass(frozen=True)
class EvalConfig:
    """One row of an evaluation: a policy at a budget, and the budget as typed and as a share of the reference."""

    policy: Policy
    spec: str | None = None  # "20%" or "256"; None for the full cache
    budget_pct: float | None = None

    @property
    def label(self) -> str:
        return self.policy.name if self.policy.budget is None else f"{self.policy.name} {self.policy.budget}"

    def record(self) -> dict:
        return {"policy": self.policy.name, "budget": self.policy.budget, "budget_pct": self.budget_pct}


def make_configs(
    policies: Sequence[str],
    budgets: Sequence[BudgetSpec],
    n: int,
    **knobs,
) -> list[EvalConfig]:
    """The full cache (the reference, first) and every (policy, budget), resolved against reference length n;
    knobs are make_policy's keyword settings (heavy_ratio, sinks, window, kernel)."""
    configs = [EvalConfig(make_policy("full"))]
    for name in dict.fromkeys(policies):
        if name == "full":
            continue
        for spec in budgets:
            tokens = spec.tokens(n)
            policy = make_policy(name, tokens, **knobs)
            configs.append(EvalConfig(policy, str(spec), round(100 * tokens / n, 2)))
    return configs


def make_eval_cache(
    model,
    policies: Sequence[Policy],
    rows: Sequence[int] | None = None,
    positions: str | Sequence[str] = "absolute",
    context: int | None = None,
    kv_quant: str = "none",
) -> H2OCache:
    """The one place evaluation caches are built: policy g serves `rows[g]` consecutive batch rows (default 1),
    numbering tokens by `positions` (one mode for all, or one per policy). `kv_quant` stores the held keys and
    values in 8 bits (`engine/storage/quant.py`); a cache of full-cache rows only, the reference, stays unquantized."""
    modes = [positions] * len(policies) if isinstance(positions, str) else list(positions)
    rows = list(rows) if rows else [1] * len(policies)
    if all(p.capacity is None for p in policies):
        kv_quant = "none"
    return H2OCache.for_model(model, list(policies), modes, context, rows, kv_quant)


# -- texts and prompts ---------------------------------------------------------------------------------------
def read_text(path: Path | None = None, shipped: str = "alice.txt") -> str:
    """A user's text file, or one of the shipped public-domain texts (h2o_chat/data)."""
    if path is None:
        return resources.files("h2o_chat").joinpath("data", shipped).read_text(encoding="utf-8")
    text = read_user_text(path, "text file")
    if not text.strip():
        raise InputError(f"text file is empty: {path}")
    return text


def token_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_ids(tokenizer, content: str) -> list[int]:
    """One user message rendered with the chat template (plain tokens for a model without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return token_ids(tokenizer, content)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])


# -- perplexity ----------------------------------------------------------------------------------------------
@dataclass
class PplResult:
    """Teacher-forced perplexity of one configuration; `nll[t]` = -log p(token t+1 | tokens 0..t)."""

    config: EvalConfig
    nll: torch.Tensor  # (tokens - 1,) fp32
    seconds: float  # of the whole run (all configurations together)
    kept: float  # tokens held per layer and head at the end
    window: int = 1000
    prompt_tokens: int = 1  # read as one prompt before scoring

    @property
    def tokens(self) -> int:
        return self.nll.numel() + self.prompt_tokens

    @property
    def ppl(self) -> float:
        return math.exp(float(self.nll.mean()))

    def window_ppl(self, window: int | None = None) -> list[float]:
        """Perplexity per window of `window` predicted tokens (the last window may be shorter)."""
        w = window or self.window
        return [math.exp(float(chunk.mean())) for chunk in self.nll.split(w)]

    def record(self) -> dict:
        return {
            **self.config.record(),
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "ppl": round(self.ppl, 4),
            "nll": round(float(self.nll.mean()), 5),
            "kept": round(self.kept, 1),
            "window": self.window,
            "window_ppl": [round(p, 3) for p in self.window_ppl()],
            "spec": self.config.spec,
            "seconds": round(self.seconds, 1),
        }


@torch.inference_mode()
def streaming_nll(
    model,
    ids: torch.Tensor,
    policies: Sequence[Policy],
    positions: str | Sequence[str] = "absolute",
    progress: Progress = None,
    on_step: Callable[[int, H2OCache, torch.Tensor], None] | None = None,
    prompt_tokens: int = 1,
    context: int | None = None,
    decode: str = "auto",
    kv_quant: str = "none",
) -> tuple[torch.Tensor, H2OCache]:
    """Teacher-force ids (1, N) through one cache row per policy. The first `prompt_tokens` are one prefill (a
    prompt: chunked, and compressed by policies that compress prompts), then one decode step per token.
    Returns the NLL of tokens prompt_tokens..N-1, (G, N - prompt_tokens). `on_step(t, cache, nll)` runs after
    token t is predicted (the soak samples memory there, and reads a finished window's NLL: `nll` on the device,
    filled up to column t - prompt_tokens). `context` overrides the trained context."""
    G, N, P = len(policies), ids.shape[1], prompt_tokens
    cache = make_eval_cache(model, policies, positions=positions, context=context, kv_quant=kv_quant)
    cache.reserve(N)  # the full cache's rows allocate once
    engine = eval_engine(model, cache, decode)
    x = ids.to(engine.device).expand(G, -1)  # (G, N)
    nll = torch.empty(G, N - P, device=engine.device)  # filled on the device, read once at the end
    logits = engine.prefill(x[:, :P], progress=_prompt_part(progress, P, N))  # (G, V)
    scored = 0  # columns of nll filled
    try:
        for t in range(P, N):
            nll[:, t - P] = F.cross_entropy(logits.float(), x[:, t], reduction="none")
            scored += 1
            if on_step is not None:
                on_step(t, cache, nll)
            if t < N - 1:
                logits, _ = engine.decode(x[:, t])
            if progress is not None:
                progress(t + 1, N)
    except KeyboardInterrupt:
        if not scored:
            raise
        raise Scored(nll[:, :scored].cpu(), cache) from None
    return nll.cpu(), cache


class Scored(KeyboardInterrupt):
    """Ctrl-C in `streaming_nll` once tokens were scored: their NLL, (G, scored), and the cache as it stands."""

    def __init__(self, nll: torch.Tensor, cache: H2OCache):
        super().__init__(f"{nll.shape[1]} tokens scored")
        self.nll, self.cache = nll, cache


def perplexity(
    model,
    ids: torch.Tensor,
    configs: Sequence[EvalConfig],
    positions: str = "absolute",
    progress: Progress = None,
    prompt_tokens: int = 1,
    decode: str = "auto",
    kv_quant: str = "none",
) -> list[PplResult]:
    """Teacher-forced perplexity of every configuration. The budgeted ones run as rows of one cache, token by
    token; the full cache's perplexity is the same sum over a causal forward of the text, which is computed
    in chunks (a full cache row beside them would make every row attend over the whole text's slots)."""
    t0 = time.perf_counter()
    full, rest = split_full(configs)
    N = ids.shape[1]
    nll: dict[int, torch.Tensor] = {}
    kept: dict[int, float] = {}
    if full:
        whole = full_nll(model, ids, prompt_tokens)
        for g in full:
            nll[g], kept[g] = whole, float(N)
        if progress is not None:
            progress(N if not rest else 0, N)  # done, or the budgeted rows' reading starts now
    if rest:
        policies = [configs[g].policy for g in rest]
        try:
            part, cache = streaming_nll(
                model, ids, policies, positions, progress, None, prompt_tokens, decode=decode, kv_quant=kv_quant
            )
        except Scored as cut:  # every row over the tokens the budgeted rows scored, the full cache's too
            done = cut.nll.shape[1]
            for g, row, stats in zip(rest, cut.nll, cut.cache.group_stats(), strict=True):
                nll[g], kept[g] = row, stats.kept
            seconds = time.perf_counter() - t0
            cut_short = [PplResult(c, nll[g][:done], seconds, kept[g], prompt_tokens=prompt_tokens) for g, c in
                         enumerate(configs)]  # fmt: skip
            note = f"interrupted: {done} of {N - prompt_tokens} tokens scored"
            raise Stopped([r.record() for r in cut_short], note) from None
        for g, row, stats in zip(rest, part, cache.group_stats(), strict=True):
            nll[g], kept[g] = row, stats.kept
    seconds = time.perf_counter() - t0
    return [PplResult(c, nll[g], seconds, kept[g], prompt_tokens=prompt_tokens) for g, c in enumerate(configs)]


def split_full(configs: Sequence[EvalConfig]) -> tuple[list[int], list[int]]:
    """Indices of the full-cache configurations and of the budgeted ones: a full row in a batch would make every
    row's storage hold the whole text, so evaluations run the full cache on its own."""
    full = [g for g, c in enumerate(configs) if c.policy.capacity is None]
    return full, [g for g in range(len(configs)) if g not in full]


@torch.inference_mode()
def full_nll(model, ids: torch.Tensor, prompt_tokens: int = 1, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """NLL of tokens prompt_tokens..N-1 of ids (1, N) with every token attended (the full cache), from causal
    forwards in chunks over a growing DynamicCache: what teacher-forcing through a full cache computes."""
    from transformers import DynamicCache

    from h2o_chat.measure.bench import attention

    device = next(model.parameters()).device
    x = ids.to(device)
    cache, keyword = DynamicCache(config=model.config), cache_keyword(model)
    out = []
    with attention(model, "sdpa"):
        for s in range(0, x.shape[1], chunk):
            logits = model(input_ids=x[:, s : s + chunk], use_cache=True, **{keyword: cache}).logits[0]
            out.append(F.cross_entropy(logits[:-1].float(), x[0, s + 1 : s + chunk], reduction="none"))
            if s + chunk < x.shape[1]:  # the chunk's last position predicts the next chunk's first token
                out.append(F.cross_entropy(logits[-1:].float(), x[0, s + chunk : s + chunk + 1], reduction="none"))
    return torch.cat(out)[prompt_tokens - 1 :].cpu()


# -- greedy continuations for many prompts x configurations --------------------------------------------------
@torch.inference_mode()
def greedy_rows(
    model,
    tokenizer,
    prompts: Sequence[list[int]],
    configs: Sequence[EvalConfig],
    max_new_tokens: int,
    chunk_size: int = DEFAULT_CHUNK,
    positions: str = "absolute",
    progress: Progress = None,
    decode: str = "auto",
    kv_quant: str = "none",
) -> list[list[list[int]]]:
    """Greedy continuation of every prompt under every configuration: the budgeted configurations as rows of one
    left-padded batch, the full cache's (which must hold every token) as another. Returns out[c][p]: prompt p
    under configs[c], cut before the first stop token. `progress(done, total)` counts the prompt's columns,
    then one per decode step; with two batches each column counts as its batch's share of the rows."""
    full, rest = split_full(configs)
    if full and rest:
        out: dict[int, list[list[int]]] = {}
        W = len(configs)  # a column of a part advances the bar by that part's share of the rows
        for part, before in ((full, 0), (rest, len(full))):
            share = None
            if progress is not None:
                share = lambda d, t, w=len(part), b=before: progress((b * t + w * d) // W, t)  # noqa: E731
            rows = greedy_rows(
                *(model, tokenizer, prompts, [configs[g] for g in part], max_new_tokens, chunk_size, positions),
                share,
                decode,
                kv_quant,
            )
            out.update(zip(part, rows, strict=True))
        return [out[g] for g in range(len(configs))]
    P = len(prompts)
    ids, mask = left_pad(list(prompts) * len(configs), tokenizer.pad_token_id or 0)
    policies = [c.policy for c in configs]
    cache = make_eval_cache(model, policies, rows=[P] * len(configs), positions=positions, kv_quant=kv_quant)
    cache.reserve(ids.shape[1] + max_new_tokens)
    engine = eval_engine(model, cache, decode)
    stops = torch.tensor(sorted(stop_token_ids(tokenizer, model)), dtype=torch.long, device=engine.device)
    L = ids.shape[1]
    total = L + max_new_tokens
    logits = engine.prefill(ids, mask, chunk_size, progress=_prompt_part(progress, L, total))
    tokens = engine.first_tokens(logits)  # (B,)
    done = torch.isin(tokens, stops)
    steps = [tokens]
    for i in range(1, max_new_tokens):
        if i % 16 == 0 and bool(done.all()):  # a host sync every 16 steps, not every step
            break
        tokens = engine.decode(tokens if i == 1 else None)[1].clone()  # a captured step's output is reused
        steps.append(tokens)
        done |= torch.isin(tokens, stops)
        if progress is not None:
            progress(L + i, total)
    if progress is not None:
        progress(total, total)
    rows = torch.stack(steps, 1).tolist()  # (B, steps)
    stop_set = set(stops.tolist())
    cut = [next((row[:j] for j, t in enumerate(row) if t in stop_set), row) for row in rows]
    return [cut[c * P : (c + 1) * P] for c in range(len(configs))]


def greedy_groups(
    model,
    tokenizer,
    prompts: Sequence[list[int]],
    configs: Sequence[EvalConfig],
    groups: Sequence[Sequence[int]],
    max_new_tokens: int,
    chunk_size: int = DEFAULT_CHUNK,
    positions: str = "absolute",
    progress: Progress = None,
    decode: str = "auto",
    kv_quant: str = "none",
) -> Iterator[tuple[Sequence[int], list[list[list[int]]]]]:
    """`greedy_rows` a group of prompts at a time (`groups`: indices into `prompts`), yielding each group's
    indices and out[c][i] as it finishes, so that a Ctrl-C keeps the groups already done. `progress` counts the
    columns of every group on one scale: each group's prompt columns (its longest prompt), then its steps."""
    totals = [max(len(prompts[i]) for i in group) + max_new_tokens for group in groups]
    whole, before = sum(totals), 0
    for group, total in zip(groups, totals, strict=True):
        part = None
        if progress is not None:
            part = lambda d, t, b=before, n=total: progress(b + d * n // max(1, t), whole)  # noqa: E731
        outs = greedy_rows(
            *(model, tokenizer, [prompts[i] for i in group], configs, max_new_tokens, chunk_size, positions),
            part,
            decode,
            kv_quant,
        )
        before += total
        yield group, outs
