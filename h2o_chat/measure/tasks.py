"""Long-context tasks over the same cache as the chat: needle retrieval and generation agreement.

- needle: a 4-digit code hidden at several depths of a long text and asked for at the end (exact match).
- agreement: ROUGE-L F1 (LCS over token ids) of each configuration's greedy continuation against the full
  cache's, and how many tokens they share before the first difference.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from h2o_chat.engine.step.generate import DEFAULT_CHUNK
from h2o_chat.errors import ConfigError
from h2o_chat.measure.evaluate import EvalConfig, Progress, Stopped, chat_ids, greedy_groups, token_ids

# -- needle in a haystack ------------------------------------------------------------------------------------
NEEDLE = "The secret code is {code}."
# The tiny embedded model answers every depth with the full cache only when told up front to look for the code
# and asked again after the text; the answer is a sentence ("The secret code is 4831.") of about 12 tokens.
NEEDLE_PROMPT = (
    "There is a secret code hidden in the following text. Find it.\n\n<text>\n{haystack}\n</text>\n\n"
    "What is the secret code? Reply with the number only."
)


@dataclass(frozen=True)
class Trial:
    haystack: str
    depth: float
    code: str
    ids: list[int]


def hide(text: str, needle: str, depth: float) -> str:
    """Insert the needle at `depth` of the text (by characters), moved on to the next sentence or paragraph end."""
    at = round(len(text) * depth)
    if 0 < at < len(text):
        ends = [i for i in (text.find(". ", at) + 1, text.find("\n\n", at)) if i > 0]
        at = min(ends, default=len(text))
    return f"{text[:at]} {needle} {text[at:]}".strip()


def needle_trials(
    tokenizer, haystacks: dict[str, str], depths: Sequence[float], haystack_tokens: int = 1500, seed: int = 0
) -> list[Trial]:
    """One prompt per (haystack, depth), each with its own random 4-digit code (repeatable by seed)."""
    rng = random.Random(seed)
    trials = []
    for name, text in haystacks.items():
        filler = tokenizer.decode(token_ids(tokenizer, text)[:haystack_tokens])
        for depth in depths:
            code = str(rng.randint(1000, 9999))
            prompt = NEEDLE_PROMPT.format(haystack=hide(filler, NEEDLE.format(code=code), depth))
            trials.append(Trial(name, depth, code, chat_ids(tokenizer, prompt)))
    return trials


def needle(
    model,
    tokenizer,
    trials: Sequence[Trial],
    configs: Sequence[EvalConfig],
    answer_tokens: int = 16,
    chunk_size: int = DEFAULT_CHUNK,
    positions: str = "absolute",
    progress: Progress = None,
    decode: str = "auto",
    kv_quant: str = "none",
) -> list[dict]:
    """Accuracy per configuration and depth: a trial is correct when its 4 digits appear in the greedy answer.
    The trials of one depth are read together, a depth at a time: a Ctrl-C raises `Stopped` with the records of
    the depths finished (each record is one configuration at one depth)."""
    depths = list(dict.fromkeys(t.depth for t in trials))
    groups = [[i for i, t in enumerate(trials) if t.depth == depth] for depth in depths]
    answers: dict[int, list[list[int]]] = {}  # trial -> its answer under each configuration
    run = greedy_groups(
        *(model, tokenizer, [t.ids for t in trials], configs, groups, answer_tokens, chunk_size, positions),
        *(progress, decode, kv_quant),
    )
    try:
        for group, outs in run:
            answers.update((i, [out[k] for out in outs]) for k, i in enumerate(group))
    except KeyboardInterrupt:
        done = [d for d, group in zip(depths, groups, strict=True) if all(i in answers for i in group)]
        if not done:
            raise
        records = _needle_records(tokenizer, trials, configs, answers, done)
        raise Stopped(records, f"interrupted: {len(done)} of {len(depths)} depths done") from None
    return _needle_records(tokenizer, trials, configs, answers, depths)


def _needle_records(tokenizer, trials, configs, answers: dict[int, list[list[int]]], depths) -> list[dict]:
    records = []
    for c, config in enumerate(configs):
        for depth in depths:
            rows = []
            for i, trial in enumerate(trials):
                if trial.depth == depth:
                    text = tokenizer.decode(answers[i][c], skip_special_tokens=True)
                    rows.append(
                        {"haystack": trial.haystack, "code": trial.code, "answer": text, "correct": trial.code in text}
                    )
            correct = sum(r["correct"] for r in rows)
            records.append(
                {
                    **config.record(),
                    "depth": depth,
                    "accuracy": correct / len(rows),
                    "correct": correct,
                    "trials": len(rows),
                    "prompt_tokens": max(len(t.ids) for t in trials),
                    "spec": config.spec,
                    "answers": rows,
                }
            )
    return records


# -- generation agreement ------------------------------------------------------------------------------------
CONTINUE = "Continue the story from where this excerpt ends, in the same style."


def agree_prompts(
    tokenizer, texts: dict[str, str], n: int = 4, prompt_tokens: int = 1000
) -> list[tuple[str, list[int]]]:
    """n excerpts of `prompt_tokens` tokens, shared among the texts and evenly spaced within each, each followed
    by an instruction to continue the story; -> [(source@token offset, chat ids)]."""
    names = list(texts)
    prompts = []
    for j, name in enumerate(names):
        ids = token_ids(tokenizer, texts[name])
        count = n // len(names) + (j < n % len(names))
        span = max(0, len(ids) - prompt_tokens)
        for k in range(count):
            start = span * k // count
            excerpt = tokenizer.decode(ids[start : start + prompt_tokens])
            prompts.append((f"{name}@{start}", chat_ids(tokenizer, f"{excerpt}\n\n{CONTINUE}")))
    return prompts


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1: longest common subsequence over token ids (two empty sequences agree fully)."""
    if not candidate or not reference:
        return float(len(candidate) == len(reference))
    prev = [0] * (len(reference) + 1)
    for a in candidate:
        cur = [0]
        for j, b in enumerate(reference):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens generated before the first divergence."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def agreement(
    model,
    tokenizer,
    prompts: Sequence[tuple[str, list[int]]],
    configs: Sequence[EvalConfig],
    max_new_tokens: int = 128,
    chunk_size: int = DEFAULT_CHUNK,
    positions: str = "absolute",
    progress: Progress = None,
    decode: str = "auto",
    kv_quant: str = "none",
    group: int | None = None,
) -> list[dict]:
    """ROUGE-L F1 of each configuration's continuation against the full cache's (configs[0] is the reference).
    `group` prompts are read together (None: all): a Ctrl-C raises `Stopped` with the records over the groups
    finished."""
    if configs[0].policy.budget is not None:
        raise ConfigError("agreement needs the full cache as the first configuration")
    n = group or len(prompts)
    groups = [range(i, min(i + n, len(prompts))) for i in range(0, len(prompts), n)]
    outs: list[list[list[int]]] = [[] for _ in configs]  # outs[c][p], the prompts of the groups finished
    run = greedy_groups(
        *(model, tokenizer, [ids for _, ids in prompts], configs, groups, max_new_tokens, chunk_size, positions),
        *(progress, decode, kv_quant),
    )
    try:
        for _, part in run:
            for rows, more in zip(outs, part, strict=True):
                rows.extend(more)
    except KeyboardInterrupt:
        done = min(len(rows) for rows in outs)  # a group whose rows were being taken is left out whole
        if not done:
            raise
        outs = [rows[:done] for rows in outs]
        note = f"interrupted: {done} of {len(prompts)} prompts done"
        raise Stopped(_agree_records(prompts[:done], configs, outs, max_new_tokens), note) from None
    return _agree_records(prompts, configs, outs, max_new_tokens)


def _agree_records(prompts, configs, outs: list[list[list[int]]], max_new_tokens: int) -> list[dict]:
    records = []
    for config, rows in zip(configs, outs, strict=True):
        scores = [rouge_l(row, ref) for row, ref in zip(rows, outs[0], strict=True)]
        records.append(
            {
                **config.record(),
                "rouge_l": round(sum(scores) / len(scores), 4),
                "per_prompt": [round(s, 4) for s in scores],
                "identical": sum(row == ref for row, ref in zip(rows, outs[0], strict=True)),
                "same_prefix": [common_prefix(row, ref) for row, ref in zip(rows, outs[0], strict=True)],
                "prompts": len(prompts),
                "prompt_tokens": max(len(ids) for _, ids in prompts),
                "tokens": max_new_tokens,
                "generated": [len(r) for r in rows],
                "spec": config.spec,
                "sources": [name for name, _ in prompts],
            }
        )
    return records
