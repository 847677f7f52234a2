"""Scripted batch generation: JSONL in, JSONL out, written as each row finishes.

Input lines: {"id", "prompt"} or {"id", "messages"}, optionally "max_new_tokens", "temperature", "top_k",
"min_p", "repetition_penalty", "top_p", "seed", "budget".
Rows with the same budget that cut their candidates alike (`shape`: whether top-p cuts, whether any rule does) run
together, each with its own settings and seed, shortest first, `batch_size` at a time with continuous batching: a
row that finishes is written at once and the next waiting prompt takes its place in the running batch.
Output is appended, so a killed run loses nothing it finished, and a rerun skips the ids already in the output file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h2o_chat.app.batch.output import appending, finished_ids
from h2o_chat.app.messages import chat_ids, messages_problem, use_chat_template
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import Policy
from h2o_chat.engine.stats import mean_count
from h2o_chat.engine.step.decode import Engine, left_pad
from h2o_chat.engine.step.generate import finish_reason, stop_token_ids
from h2o_chat.engine.step.sampling import (
    Sampler,
    check_min_p,
    check_repetition_penalty,
    check_seed,
    check_temperature,
    check_top_k,
    cuts,
)
from h2o_chat.errors import H2OChatError, InputError, SettingError, StdoutError
from h2o_chat.files import read_user_bytes
from h2o_chat.models.loading import Loaded
from h2o_chat.models.memory import prefill_chunk
from h2o_chat.models.prebuild import builder_for

MAX_INPUT_BYTES = 2**30  # a batch file: one read, every line tokenized before generation starts
SKIPPED_EXIT = 4  # every valid row ran, but some lines were skipped (3 is out of memory)


@dataclass
class Item:
    id: str | int  # as the line gives it: it comes back the same in the result
    line: int
    ids: list[int]
    max_new_tokens: int
    temperature: float
    budget: int | None
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Defaults:
    max_new_tokens: int = 256
    temperature: float = 0.0
    budget: int | None = 512
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    system: str | None = None
    raw: bool = False
    ignore_eos: bool = False  # rows run to their max_new_tokens past the end-of-sequence token


@dataclass
class Summary:
    done: int = 0
    skipped: int = 0
    malformed: list[str] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


KEYS = {"id", "prompt", "messages", "max_new_tokens", "temperature", "top_k", "min_p", "repetition_penalty", "budget"}
KEYS |= {"top_p", "seed"}


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f'"{name}" must be a positive integer')
    return value


def _setting(obj: dict, name: str, default, check) -> float:
    """A line's own sampling setting (or the default), checked as the Sampler checks the command line's and said
    with the line's key."""
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f'"{name}" must be a number, got {json.dumps(value)}')
    try:
        check(value)
    except SettingError as e:
        raise ValueError(e.worded(f'"{name}"')) from None
    return value


def _check_top_p(value: float) -> None:
    """top_p as the Sampler checks it (its one home)."""
    Sampler(top_p=value)


def parse_line(text: str, number: int, tokenizer, defaults: Defaults) -> Item:
    """One input line -> Item, or ValueError with the reason."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    if "id" not in obj or not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
        raise ValueError('needs an "id" (string or integer)')
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError('needs exactly one of "prompt" or "messages"')
    unknown = set(obj) - KEYS
    if unknown:
        raise ValueError(f"unknown keys: {', '.join(sorted(unknown))}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ValueError('"prompt" must be a non-empty string')
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        messages = obj["messages"]
        problem = messages_problem(messages)
        if problem:
            raise ValueError(f'"messages": {problem}')
    max_new = _positive_int(obj.get("max_new_tokens", defaults.max_new_tokens), "max_new_tokens")
    temperature = _setting(obj, "temperature", defaults.temperature, check_temperature)
    penalty = _setting(obj, "repetition_penalty", defaults.repetition_penalty, check_repetition_penalty)
    top_k = _setting(obj, "top_k", defaults.top_k, check_top_k)
    min_p = _setting(obj, "min_p", defaults.min_p, check_min_p)
    top_p = _setting(obj, "top_p", defaults.top_p, _check_top_p)
    seed = obj.get("seed", defaults.seed)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f'"seed" must be a whole number, got {json.dumps(seed)}')
    if seed is not None:
        try:
            check_seed(seed)
        except SettingError as e:
            raise ValueError(e.worded('"seed"')) from None
    budget = obj.get("budget", defaults.budget)
    if budget is not None:
        budget = _positive_int(budget, "budget")
    if defaults.raw and "prompt" in obj:
        ids = tokenizer(obj["prompt"])["input_ids"]
    else:
        if defaults.system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": defaults.system}, *messages]
        ids = chat_ids(tokenizer, messages)
    return Item(
        obj["id"], number, ids, max_new, float(temperature), budget, float(penalty), top_k, float(min_p),
        float(top_p), seed,
    )  # fmt: skip


def read_items(
    path: Path, tokenizer, defaults: Defaults, summary: Summary, make_policy: Callable[[int | None], Policy]
) -> tuple[list[Item], dict[int | None, Policy]]:
    """The well-formed lines, and a policy for every budget they ask for; bad lines go to summary.malformed:
    a line that is not UTF-8 or not valid, a duplicate id, a budget that is impossible or does not fit in
    memory (`make_policy` raises for those). Only these lines are skipped, never the file."""
    use_chat_template(tokenizer)  # a base model's tokenizer gets the plain template, as in the chat
    lines = read_user_bytes(path, "input file", limit=MAX_INPUT_BYTES).splitlines()
    items, seen, policies, impossible = [], set(), {}, {}
    for number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff")
            if not text.strip():
                continue
            item = parse_line(text, number, tokenizer, defaults)
            if item.id in seen:
                raise ValueError(f"duplicate id {json.dumps(item.id)}")
            if item.budget in impossible:
                raise impossible[item.budget]
            if item.budget not in policies:
                try:
                    policies[item.budget] = make_policy(item.budget)
                except H2OChatError as e:
                    impossible[item.budget] = e  # every line asking for it is skipped, with the same reason
                    raise
        except UnicodeDecodeError as e:
            summary.malformed.append(f"{path.name} line {number}: not UTF-8 text (byte {e.start + 1} of the line)")
            continue
        except (ValueError, H2OChatError) as e:
            summary.malformed.append(f"{path.name} line {number}: {e}")
            continue
        seen.add(item.id)
        items.append(item)
    return items, policies


def generate_batch(
    loaded: Loaded,
    items: list[Item],
    policy: Policy,
    seed: int | None = None,
    chunk_size: int | None = None,
    positions: str = "auto",
    decode: str = "auto",
    rows: int = 8,
    kv_quant: str = "none",
    ignore_eos: bool = False,
    on_tokens: Callable[[int], None] | None = None,
) -> Iterator[dict]:
    """Continuous batching: keep `rows` batch rows busy until every item is done, yielding each item's record as
    soon as it finishes. The first `rows` prompts are read together; then a row that finishes takes the next
    waiting prompt at once (read into that row alone while the others wait one step), so the decode step --
    captured once on CUDA -- is reused for the whole run. A row decodes exactly as its prompt would alone, with
    its own sampling settings and seed (`seed`: that of the items without one; None: random) as long as the items
    are alike in `shape`. When no prompt is left and half the rows are idle, the idle rows leave the batch.
    `on_tokens(n)`, once a step: the tokens the rows took, and the allowance (max_new_tokens) left unused by
    items that finished; over the run they add up to the items' max_new_tokens."""
    model, tok = loaded.model, loaded.tokenizer
    stops = set() if ignore_eos else stop_token_ids(tok, model)
    R = min(rows, len(items))
    cache = H2OCache.for_model(model, policy, positions, loaded.context, kv_quant=kv_quant)
    cache.reserve(max(len(it.ids) for it in items) + max(it.max_new_tokens for it in items))  # a full cache, once
    engine = Engine(model, cache, decode)
    engine.builder = builder_for(loaded)
    # the sampler's shape (which operations a step runs) must serve every item, not only the first rows
    engine.set_sampler(Sampler(seed=seed), len(items), **_sampling(items, lists=True))
    engine.sampler.select_rows(torch.arange(R))
    t0 = time.perf_counter()
    ids, mask = left_pad([it.ids for it in items[:R]], tok.pad_token_id or 0)
    chunk, _ = prefill_chunk(model, cache, R, ids.shape[1], chunk_size)  # smaller when memory is short
    tokens = engine.first_tokens(engine.prefill(ids, mask, chunk))
    queue = list(range(R, len(items)))
    slot: list[int | None] = list(range(R))  # the item each batch row is generating, None when idle
    out: dict[int, list[int]] = {i: [] for i in range(R)}
    started = dict.fromkeys(range(R), t0)
    prompt_seconds = dict.fromkeys(range(R), time.perf_counter() - t0)
    most = {i: reply_cap(items[i].max_new_tokens, cache.room(i)) for i in range(R)}

    taken = 0  # for on_tokens: since it was last told

    def finished(i: int, token: int) -> str | None:
        """Take item i's next token; the reason it is done, or None."""
        nonlocal taken
        taken += 1
        reason = finish_reason(token, len(out[i]) + 1, most[i], stops)
        if reason != "stop":
            out[i].append(token)
        return reason

    while True:
        step = tokens.tolist()  # the host reads this step's tokens (one wait per step)
        for r, token in enumerate(step):
            i = slot[r]
            reason = None if i is None else finished(i, token)
            while reason is not None:  # the row's item is done: write it, and a waiting prompt takes the row
                generated = out.pop(i)
                stats = {**cache.row_stats(r), "generated": len(generated) + (reason == "stop")}
                taken += max(0, items[i].max_new_tokens - stats["generated"])
                text = tok.decode(generated, skip_special_tokens=True)
                yield _record(items[i], text, reason, stats, policy, started[i], prompt_seconds[i], R)
                slot[r], reason = None, None
                if queue:
                    i = slot[r] = queue.pop(0)
                    started[i], out[i] = time.perf_counter(), []
                    chunk, _ = prefill_chunk(model, cache, 1, len(items[i].ids), chunk_size)
                    first = engine.refill(r, torch.tensor([items[i].ids]), chunk, **_sampling([items[i]]))
                    most[i] = reply_cap(items[i].max_new_tokens, cache.room(r))
                    prompt_seconds[i] = time.perf_counter() - started[i]
                    tokens[r] = first
                    reason = finished(i, int(first))  # fed with the next step unless it already ends the item
        if on_tokens is not None and taken:
            on_tokens(taken)
            taken = 0
        active = [r for r, i in enumerate(slot) if i is not None]
        if not active:
            return
        if not queue and len(active) <= len(slot) // 2:  # idle rows leave together: one new capture
            index = torch.tensor(active)
            engine.select_rows(index)
            tokens, slot = tokens[index.to(tokens.device)], [slot[r] for r in active]
        tokens = engine.decode(tokens)[1].clone()  # a captured step's output is overwritten by the next step


def reply_cap(max_new_tokens: int, room: int | None) -> int:
    """A row's most tokens: its max_new_tokens, or fewer where the model's learned positions end (OPT's: `room`
    tokens can still be fed, and a reply's last token never is); such a line ends at "length" whole, and the
    others run on (before, the whole run stopped there)."""
    return max_new_tokens if room is None else max(1, min(max_new_tokens, room + 1))


def shape(it: Item) -> tuple[bool, bool]:
    """What a line's sampling asks of a step's sampler: whether top-p cuts its candidates, and whether any rule
    (top-p, top-k, min-p) does. Lines alike in it share a batch, each drawing as it would alone; a greedy line
    draws the same in any (its filters do nothing)."""
    return (False, False) if it.temperature == 0 else cuts(it.top_p, it.top_k, it.min_p)


def _sampling(items: list[Item], lists: bool = False) -> dict:
    """Per-row sampling settings of `items` (a greedy row's filters left out: `shape`): lists for a new sampler,
    or one row's values for a refill."""
    rows = [
        {
            "temperature": it.temperature,
            "repetition_penalty": it.repetition_penalty,
            "top_k": it.top_k if it.temperature > 0 else 0,
            "min_p": it.min_p if it.temperature > 0 else 0.0,
            "top_p": it.top_p if it.temperature > 0 else 1.0,
            "seed": it.seed,
        }
        for it in items
    ]
    if lists:
        return {k: [row[k] for row in rows] for k in rows[0]}
    row = rows[0]
    row["penalty"] = row.pop("repetition_penalty")
    return row


def _record(item: Item, text: str, reason: str, stats: dict, policy: Policy, started, prompt_seconds, rows) -> dict:
    """One output line: the item's text, token counts, timings and what its cache row kept."""
    return {
        "id": item.id,
        "text": text,
        "finish_reason": reason,
        "prompt_tokens": len(item.ids),
        "generated_tokens": stats["generated"],
        "seconds": round(time.perf_counter() - started, 3),
        "prompt_seconds": round(prompt_seconds, 3),
        "cache": {
            "policy": policy.name,
            "budget": policy.budget,
            "seen": stats["seen"],
            "kept": mean_count(stats["kept"]),
            "evicted": mean_count(stats["evicted"]),
        },
        "batch_rows": rows,
    }


def run_batch(
    loaded: Loaded,
    input_path: Path,
    output_path: Path,
    make_policy: Callable[[int | None], Policy],
    defaults: Defaults,
    batch_size: int = 8,
    chunk_size: int | None = None,
    on_record: Callable[[dict], None] | None = None,
    positions: str = "auto",
    decode: str = "auto",
    on_skip: Callable[[str], None] | None = None,
    kv_quant: str = "none",
    done: set[str | int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Summary:
    """Generate every well-formed line not yet in the output (`-`: stdout; `done`: its ids, when the caller has
    read them already). Malformed and duplicate lines are passed to `on_skip` before anything is generated (a
    long run should not hide them until its end). `progress(done, total)`: tokens, of every line's max_new_tokens
    (a line that ends early counts the rest of its allowance)."""
    summary = Summary()
    items, by_budget = read_items(input_path, loaded.tokenizer, defaults, summary, make_policy)
    if on_skip:
        for problem in summary.malformed:
            on_skip(problem)
    if summary.malformed and not items:
        raise InputError(f"no line of {input_path.name} can be run: all {len(summary.malformed)} were skipped")
    if not items:
        raise InputError(f"{input_path.name} has no lines to run: give one JSON object per line")
    done = finished_ids(output_path) if done is None else done
    todo = [it for it in items if it.id not in done]
    summary.skipped = len(items) - len(todo)
    # rows share a cache policy and what their sampling asks of a step (`shape`): one batch for each such group,
    # each row with its own settings and seed
    groups = sorted({(it.budget, shape(it)) for it in todo}, key=lambda g: (g[0] or 0, g[1]))
    t0 = time.perf_counter()
    total, counted = sum(it.max_new_tokens for it in todo), 0

    def on_tokens(n: int) -> None:
        nonlocal counted
        counted += n
        progress(counted, total)

    with appending(output_path) as out:
        for budget, kind in groups:
            group = [it for it in todo if (it.budget, shape(it)) == (budget, kind)]
            group.sort(key=lambda it: len(it.ids))
            records = generate_batch(
                *(loaded, group, by_budget[budget], None, chunk_size, positions, decode),
                rows=batch_size,
                kv_quant=kv_quant,
                ignore_eos=defaults.ignore_eos,
                on_tokens=None if progress is None else on_tokens,
            )
            for record in records:
                try:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()  # a killed run keeps every finished row
                except StdoutError:
                    raise  # -o -: the CLI's one line for stdout
                except OSError as e:  # a full disk: what is written stays, a rerun resumes (a cut line set aside)
                    raise InputError(
                        f"cannot write {output_path}: {e.strerror}; {summary.done} rows written, a rerun with the "
                        "same -o resumes"
                    ) from None
                summary.done += 1
                summary.tokens += record["generated_tokens"]
                if on_record:
                    on_record(record)
    summary.seconds = time.perf_counter() - t0
    return summary
