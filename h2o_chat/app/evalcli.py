"""`h2o-chat eval`: what a budget costs in quality (perplexity, needle retrieval, generation agreement).

Options in, calls out: the work is in `h2o_chat.measure.evaluate`, tables and figures in
`h2o_chat.measure.plots`. Every input is checked before the weights load. No torch import at module level
(start-up stays fast for --help).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from h2o_chat.app.options import (
    ChunkSize,
    Command,
    Group,
    KvQuant,
    ModelOptions,
    PolicyKnobs,
    Positions,
    check_kv_quant,
    check_positions,
    check_positive,
    grouped,
)
from h2o_chat.app.reporting import reported, status, summarised
from h2o_chat.app.ui import plural, progress_bar
from h2o_chat.errors import ConfigError, InputError
from h2o_chat.files import unwritable

eval_app = typer.Typer(
    cls=Group,
    no_args_is_help=True,
    help="Measure what a cache budget costs in quality: perplexity, long-context retrieval, agreement.",
)

DEFAULT_BUDGETS = ("10%", "20%")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")

Budgets = Annotated[
    list[str] | None,
    typer.Option(
        "--budget",
        "-b",
        help="KV budget per layer and head: tokens (256) or a share of the text or prompt (20%). "
        "Repeat for several. Default: 10% and 20%.",
    ),
]
# the defaults the help names are `evaluate.DEFAULT_POLICIES`, `recall.DEFAULT_POLICIES`, `evaluate.SHIPPED` and
# `dialogues.RECALL_TEXTS`, written out: importing them would import torch for --help (a test holds them equal)
Policies = Annotated[
    list[str] | None,
    typer.Option(
        "--policy", "-p", help="Policy to compare with the full cache; repeat. Default: h2o, snap, sink, recent."
    ),
]
RecallPolicies = Annotated[
    list[str] | None,
    typer.Option("--policy", "-p", help="Policy to compare with the full cache; repeat. Default: h2o, snap, recall."),
]
JsonOut = Annotated[bool, typer.Option("--json", help="One JSON record per line instead of a table.")]
AnswerTokens = Annotated[int, typer.Option(help="Greedy tokens of answer.")]
Plot = Annotated[Path | None, typer.Option(help="Also draw a figure to this file (.png, .svg or .pdf).")]
MarkdownOut = Annotated[Path | None, typer.Option("--markdown", help="Also write the table as markdown here.")]
Texts = Annotated[
    list[Path] | None,
    typer.Option(help="UTF-8 text file; repeat for several. Default: the shipped alice.txt and moby_dick.txt."),
]
RecallTexts = Annotated[
    list[Path] | None,
    typer.Option(help="UTF-8 text file; repeat for several. Default: the shipped workshop.txt and as_you_like_it.txt."),
]


def loaded_for_eval(models: ModelOptions):
    """The model, whose engines (`evaluate.eval_engine`) get their compiled steps built in the background when
    their kind is not built yet (said on stderr), as the chat's do: an evaluation runs for minutes or hours."""
    from h2o_chat.models.prebuild import builder_for

    loaded = models.load()
    loaded.model.step_builder = builder_for(loaded, status)
    return loaded


def ran_on(loaded) -> dict:
    """What every eval record says of where and when it ran: the model, the machine, the date (UTC)."""
    from datetime import UTC, datetime

    from h2o_chat.app.ui import describe_machine

    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return {"model": loaded.spec.name, "machine": describe_machine(loaded), "date": date}


@dataclass(frozen=True)
class Compared:
    """What an evaluation compares with the full cache, and where its records go."""

    budget: Budgets = None
    policy: Policies = None
    positions: Positions = "absolute"
    kv_quant: KvQuant = "none"
    json_out: JsonOut = False
    markdown_path: MarkdownOut = None
    PANEL: ClassVar[str] = "Compared"

    def plan(self, n: int, knobs: PolicyKnobs, plot: Path | None = None):
        """Parse and validate what does not need the model; -> (budget specs, policy names)."""
        from h2o_chat.measure import evaluate as ev

        specs = [ev.BudgetSpec.parse(b) for b in self.budget or DEFAULT_BUDGETS]
        names = list(self.policy or ev.DEFAULT_POLICIES)
        ev.make_configs(names, specs, n, **knobs.kwargs())  # unknown policies, impossible budgets
        check_positions(self.positions)
        check_kv_quant(self.kv_quant)
        if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
            raise ConfigError(f"--plot must end in {', '.join(PLOT_SUFFIXES)}, got {plot.name!r}")
        for option, path in (("--plot", plot), ("--markdown", self.markdown_path)):
            check_output(option, path)
        return specs, names


@dataclass(frozen=True)
class RecallCompared(Compared):
    """`Compared` for eval recall, whose default policies are its own."""

    policy: RecallPolicies = None


def check_output(option: str, path: Path | None) -> None:
    """A file the run writes at its end, checked before the model loads (a run of minutes or hours should not die
    at its last line): not a folder, in a folder that exists, and writable."""
    if path is None:
        return
    if path.is_dir():
        raise InputError(f"{option} {path} is a folder, not a file")
    if not path.parent.is_dir():
        raise InputError(f"output folder does not exist: {path.parent}")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"cannot write {option} {path}: permission denied")
    why = None if path.exists() else unwritable(path.parent)
    if why is not None:
        raise InputError(f"cannot write {option} {path}: {why}")


def forecast(bar, label: str, rows: int | None, unit: str = "step"):
    """The progress callback `bar` plus one line once the first steps are timed: seconds per step for all rows
    together, and the time the whole run will take at that speed (said up front, not discovered at the end).
    `rows` None: progress is not in steps of all rows together (recall counts token-rows): the time left only."""
    import time

    from h2o_chat.app.ui import duration

    first: list = []

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if not first:
            first.append((now, done))
        elif len(first) == 1 and done - first[0][1] >= max(8, total // 64):
            per = (now - first[0][0]) / (done - first[0][1])
            first.append(per)
            left = f"about {duration(per * (total - done))} left"
            status(f"{label}: {per:.2f} s per {unit} for {rows} rows together; {left}" if rows else f"{label}: {left}")
        bar(done, total)

    return progress


def _texts(paths: list[Path] | None, shipped: tuple[str, ...] | None = None) -> dict[str, str]:
    """The user's text files by name, or else the shipped texts (`shipped`, default: every shipped novel)."""
    from h2o_chat.measure import evaluate as ev

    if not paths:
        return {name: ev.read_text(shipped=name) for name in (shipped or ev.SHIPPED)}
    return {path.name: ev.read_text(path) for path in paths}


def _emitter(table_of: Callable, compared: Compared, loaded, plot: Path | None = None, draw: Callable | None = None,
             **fields) -> Callable[..., None]:  # fmt: skip
    """`emit(records, note="")` for a finished or interrupted run (`summarised`): each record with `fields`, where
    and when it ran (`ran_on`) and the KV storage, then `_emit`."""

    def emit(records: list[dict], note: str = "") -> None:
        about = {**fields, **ran_on(loaded), "kv_quant": compared.kv_quant}  # once, for every record
        records = [{**r, **about} for r in records]
        _emit(records, table_of(records), compared, plot, draw, note)

    return emit


def _emit(records: list[dict], table, compared: Compared, plot: Path | None, draw: Callable | None, note: str = ""):
    """The records to stdout (JSON lines or the table), the table to --markdown, the figure to --plot. `note`: the
    run was interrupted, the records summarise what it finished ("interrupted: 2 of 30 conversations done"):
    said in the table's title, and on a line under the table on stdout."""
    from h2o_chat.measure import plots

    title, header, rows = table
    if compared.kv_quant != "none":  # the budgeted rows' storage; the full cache, the reference, is not quantized
        title = f"{title}; budgeted rows hold keys and values in {compared.kv_quant.replace('bit', ' bits')}"
    table = (f"{title} ({note})" if note else title, header, rows)
    if compared.json_out:
        for record in records:
            typer.echo(json.dumps(record, ensure_ascii=False))
    else:
        from h2o_chat.app.ui import make_console, rich_table

        make_console().print(rich_table(table))
        if note:
            typer.echo(note)
    if compared.markdown_path is not None:
        compared.markdown_path.write_text(plots.markdown(table), encoding="utf-8")
    if plot is not None:
        draw(records, plot)
        status(f"wrote {plot}")


@eval_app.command("ppl", cls=Command)
@grouped
def ppl_command(
    text: Annotated[Path | None, typer.Option(help="UTF-8 text to score. Default: the shipped Alice.")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens of the text to score (all of it if shorter).")] = 2048,
    prompt_tokens: Annotated[
        int,
        typer.Option(
            help="Read the first P tokens as one prompt (chunked; compressed "
            "by snap), then score the rest token by token."
        ),
    ] = 1,
    plot: Plot = None,
    compared: Compared = Compared(),
    models: ModelOptions = ModelOptions(),
    knobs: PolicyKnobs = PolicyKnobs(),
) -> None:
    """Streaming perplexity: teacher-force a text token by token through the cache, per policy and budget."""
    with reported():
        models.check()
        check_positive("--tokens", tokens)
        if tokens < 2:
            raise ConfigError("--tokens must be at least 2 (the first token is context, the rest are predicted)")
        if not 1 <= prompt_tokens < tokens:
            raise ConfigError(f"--prompt-tokens must be at least 1 and below --tokens ({tokens}), got {prompt_tokens}")
        specs, names = compared.plan(tokens, knobs, plot)
        from h2o_chat.measure import evaluate as ev
        from h2o_chat.measure import plots

        content = ev.read_text(text)
        loaded = loaded_for_eval(models)
        import torch

        ids = ev.token_ids(loaded.tokenizer, content)[:tokens]
        if len(ids) <= prompt_tokens:
            raise InputError(f"{text or 'the text'} has {len(ids)} tokens, not more than --prompt-tokens")
        if len(ids) < tokens:
            status(f"the text has {len(ids)} tokens; scoring all of them")
        configs = ev.make_configs(names, specs, len(ids), **knobs.kwargs())
        status(f"ppl over {len(ids)} tokens: {', '.join(c.label for c in configs)}")
        source = text.name if text else "alice.txt"
        emit = _emitter(plots.ppl_table, compared, loaded, plot, plots.ppl_plot, text=source)
        with summarised(emit), progress_bar(f"ppl, {len(configs)} rows") as bar:
            results = ev.perplexity(
                *(loaded.model, torch.tensor([ids]), configs, compared.positions),
                forecast(bar, "ppl", len(configs), "token"),
                prompt_tokens,
                decode=models.decode,
                kv_quant=compared.kv_quant,
            )
        emit([r.record() for r in results])


@eval_app.command("needle", cls=Command)
@grouped
def needle_command(
    haystack: Texts = None,
    haystack_tokens: Annotated[int, typer.Option(help="Tokens of filler text per haystack.")] = 1500,
    depth: Annotated[
        list[float] | None, typer.Option(help="Where the code goes, 0 (start) to 1 (end); repeat. Default: 0.1 0.5 0.9")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for the random 4-digit codes.")] = 0,
    answer_tokens: AnswerTokens = 16,
    chunk_size: ChunkSize = 512,
    plot: Plot = None,
    compared: Compared = Compared(),
    models: ModelOptions = ModelOptions(),
    knobs: PolicyKnobs = PolicyKnobs(),
) -> None:
    """Needle in a haystack: a secret code hidden at several depths of a long text, asked for at the end."""
    with reported():
        models.check()
        for name, value in (("--haystack-tokens", haystack_tokens), ("--answer-tokens", answer_tokens)):
            check_positive(name, value)
        check_positive("--chunk-size", chunk_size)
        depths = list(depth or (0.1, 0.5, 0.9))
        if not all(0 <= d <= 1 for d in depths):
            raise ConfigError(f"--depth must be between 0 and 1, got {', '.join(f'{d:g}' for d in depths)}")
        specs, names = compared.plan(haystack_tokens, knobs, plot)
        from h2o_chat.measure import evaluate as ev
        from h2o_chat.measure import plots, tasks

        texts = _texts(haystack)
        loaded = loaded_for_eval(models)
        trials = tasks.needle_trials(loaded.tokenizer, texts, depths, haystack_tokens, seed)
        longest = max(len(t.ids) for t in trials)
        configs = ev.make_configs(names, specs, longest, **knobs.kwargs())
        status(
            f"needle: {plural(len(trials), 'prompt')} of <= {longest} tokens x {', '.join(c.label for c in configs)}"
        )
        emit = _emitter(plots.needle_table, compared, loaded, plot, plots.needle_plot)
        rows = len(trials) // len(set(depths)) * len(configs)  # read together: a depth's trials, every configuration
        with summarised(emit), progress_bar(f"needle, {len(trials) * len(configs)} rows") as bar:
            records = tasks.needle(
                loaded.model,
                loaded.tokenizer,
                trials,
                configs,
                answer_tokens,
                chunk_size,
                compared.positions,
                forecast(bar, "needle", rows, "column"),
                models.decode,
                compared.kv_quant,
            )
        emit(records)


@eval_app.command("agree", cls=Command)
@grouped
def agree_command(
    text: Texts = None,
    prompts: Annotated[int, typer.Option(help="Excerpts, shared among the texts.")] = 4,
    prompt_tokens: Annotated[int, typer.Option(help="Tokens per excerpt.")] = 1000,
    tokens: Annotated[int, typer.Option(help="Greedy tokens generated per prompt.")] = 128,
    group: Annotated[
        int,
        typer.Option(help="Prompts read together (rows = group x configurations); a Ctrl-C keeps the groups done."),
    ] = 2,
    chunk_size: ChunkSize = 512,
    compared: Compared = Compared(),
    models: ModelOptions = ModelOptions(),
    knobs: PolicyKnobs = PolicyKnobs(),
) -> None:
    """Generation agreement: ROUGE-L F1 of each policy's greedy continuation against the full cache's."""
    with reported():
        models.check()
        for name, value in (
            ("--prompts", prompts), ("--prompt-tokens", prompt_tokens), ("--tokens", tokens), ("--group", group),
        ):  # fmt: skip
            check_positive(name, value)
        check_positive("--chunk-size", chunk_size)
        specs, names = compared.plan(prompt_tokens, knobs)
        from h2o_chat.measure import evaluate as ev
        from h2o_chat.measure import plots, tasks

        texts = _texts(text)
        loaded = loaded_for_eval(models)
        items = tasks.agree_prompts(loaded.tokenizer, texts, prompts, prompt_tokens)
        longest = max(len(ids) for _, ids in items)
        configs = ev.make_configs(names, specs, longest, **knobs.kwargs())
        status(f"agree: {plural(len(items), 'prompt')} of <= {longest} tokens x {', '.join(c.label for c in configs)}")
        emit = _emitter(plots.agree_table, compared, loaded)
        rows = min(group, len(items)) * len(configs)
        with summarised(emit), progress_bar(f"agree, {len(items) * len(configs)} rows") as bar:
            records = tasks.agreement(
                *(loaded.model, loaded.tokenizer, items, configs, tokens, chunk_size, compared.positions),
                forecast(bar, "agree", rows, "column"),
                decode=models.decode,
                kv_quant=compared.kv_quant,
                group=group,
            )
        emit(records)


@eval_app.command("recall", cls=Command)
@grouped
def recall_command(
    text: RecallTexts = None,
    conversations: Annotated[int, typer.Option(help="Conversations (each with its own facts and passages).")] = 30,
    turns: Annotated[int, typer.Option(help="User turns per conversation (at least 4; the last asks).")] = 10,
    passage_tokens: Annotated[int, typer.Option(help="Tokens of text in each passage turn.")] = 120,
    seed: Annotated[int, typer.Option(help="Seed for the facts, passages and wording.")] = 0,
    answer_tokens: AnswerTokens = 16,
    group: Annotated[int, typer.Option(help="Conversations per batch (memory: rows = group x configurations).")] = 10,
    chunk_size: ChunkSize = 512,
    plot: Plot = None,
    store: Annotated[
        list[str] | None,
        typer.Option(
            help="recall's store (repeatable): a share of what each conversation evicts (25%: it must drop), "
            "all (room for everything evicted), or default (8x the budget). Default: default."
        ),
    ] = None,
    drop: Annotated[
        str,
        typer.Option(
            help="What a full recall store drops first: score (the lowest attention) | age (the oldest) | recalls "
            "(the least recalled) | first (the latest positions: it keeps the conversation's opening)."
        ),
    ] = "first",
    compared: RecallCompared = RecallCompared(),
    models: ModelOptions = ModelOptions(),
    knobs: PolicyKnobs = PolicyKnobs(),
) -> None:
    """Multi-turn recall: facts stated early in a chat, then a question for one of them, per policy and budget.

    Between the facts and the question, unrelated turns. Scored by greedy hits
    and by the share of the full cache's likelihood gain on the answer.
    Default texts: two the policies were not tuned on (workshop, As You Like It).
    """
    with reported():
        models.check()
        for name, value in (
            ("--conversations", conversations), ("--passage-tokens", passage_tokens),
            ("--answer-tokens", answer_tokens), ("--group", group),
        ):  # fmt: skip
            check_positive(name, value)
        check_positive("--chunk-size", chunk_size)
        if turns < 4:
            raise ConfigError(f"--turns must be at least 4 (two of facts, one between, the question), got {turns}")
        from h2o_chat.measure import dialogues as dl
        from h2o_chat.measure import recall as rc

        specs, names = compared.plan(1000, knobs, plot)
        if not compared.policy:
            names = list(rc.DEFAULT_POLICIES)
        stores = [_store_option(s) for s in store or ["default"]]
        from h2o_chat.engine.policies import DROP_RULES

        if drop not in DROP_RULES:
            raise ConfigError(f"--drop must be one of {', '.join(DROP_RULES)}, got {drop!r}")
        from h2o_chat.measure import plots

        texts = _texts(text, dl.RECALL_TEXTS)
        loaded = loaded_for_eval(models)
        convs = dl.dialogues(loaded.tokenizer, texts, conversations, turns, passage_tokens, seed=seed)
        mean = sum(d.tokens for d in convs) / len(convs)
        status(
            f"recall: {plural(len(convs), 'conversation')} of {turns} turns (~{mean:.0f} tokens) x full, "
            f"{', '.join(names)} at {', '.join(map(str, specs))}"
        )
        emit = _emitter(plots.recall_table, compared, loaded, plot, plots.recall_plot, texts=", ".join(texts))
        with summarised(emit), progress_bar(f"recall, {len(convs)} conversations") as bar:
            records = rc.recall(
                loaded.model, loaded.tokenizer, convs, names, specs, greedy_tokens=answer_tokens,
                chunk_size=chunk_size, positions=compared.positions, group=group,
                progress=forecast(bar, "recall", None),
                decode=models.decode, knobs={**knobs.kwargs(), **({"drop": drop} if "recall" in names else {})},
                kv_quant=compared.kv_quant, stores=stores,
            )  # fmt: skip
        emit(records)


def _store_option(text: str) -> str | None:
    """One --store value: None (the policy's default), "all" or a share "25%"."""
    value = text.strip().lower()
    if value == "default":
        return None
    if value == "all":
        return "all"
    if value.endswith("%"):
        try:
            share = float(value[:-1])
        except ValueError:
            share = -1
        if 0 < share <= 100:
            return f"{share:g}%"
    raise ConfigError(f"--store takes a share of what a conversation evicts (25%), all or default, got {text!r}")
