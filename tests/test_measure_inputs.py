"""The measuring commands' inputs (eval, bench, soak): a bad one is refused on one line before the model loads, the
help names the defaults a run uses, and settings at the edge of their range run instead of crashing mid-run."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from h2o_chat.app import cli
from h2o_chat.measure import dialogues as dl
from h2o_chat.measure import evaluate as ev
from h2o_chat.measure import recall as rc
from h2o_chat.measure.soak import run_soak, soak_configs

runner = CliRunner()


def refused(args: list[str], *fragments: str) -> None:
    """`args` end with exit status 2 and one error line holding `fragments`, no traceback."""
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2o-chat: error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def flat_help(args: list[str]) -> str:
    result = runner.invoke(cli.app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.replace("│", " ").split())  # borders and wraps gone


# -- recall with short passages ------------------------------------------------------------------------------
def test_recall_runs_when_passages_give_replies_of_different_lengths(single_thread):
    """A passage shorter than the reply ("In short:" and the passage, cut to 24 tokens) made conversations' replies
    differ in length, and the batch that decodes them in step crashed after minutes (torch.tensor of ragged
    lists): every reply is now cut to the set's shortest."""
    tok = tiny_tokenizer()
    rng = random.Random(0)
    texts = {
        "long.txt": " ".join(f"w{rng.randrange(4, 256)}" for _ in range(400)),
        "short.txt": "w5 w6 w7 w8 w9",  # its passages have 5 tokens, the long text's 20
    }
    convs = dl.dialogues(tok, texts, count=4, turns=5, passage_tokens=20)
    lengths = {len(r) for d in convs for r in d.replies[2:]}
    assert lengths == {3 + 5}  # "In" "short" ":" and the short text's 5 tokens, for every passage reply
    assert {d.sources[0] for d in convs} == set(texts)
    records = rc.recall(tiny_model("llama", seed=1), tok, convs, ["h2o"], [ev.BudgetSpec.parse("50%")], group=4)
    assert [r["policy"] for r in records] == ["full", "without fact", "h2o"]
    assert all(len(r["answers"]) == 4 for r in records)


# -- output files, checked before the model loads ------------------------------------------------------------
TINY_EVALS = {
    "ppl": ["eval", "ppl", "--tokens", "8"],
    "needle": ["eval", "needle", "--haystack-tokens", "40", "--depth", "0.5", "--answer-tokens", "2"],
    "recall": ["eval", "recall", "--conversations", "1", "--turns", "4", "--passage-tokens", "30"],
    "agree": ["eval", "agree", "--prompts", "1", "--prompt-tokens", "16", "--tokens", "2"],
}


OUTPUTS = [*((c, "--markdown", "out.md") for c in sorted(TINY_EVALS)), *((c, "--plot", "out.png") for c in
           ("ppl", "needle", "recall"))]  # fmt: skip


@pytest.mark.parametrize(("command", "option", "name"), OUTPUTS)
def test_an_output_file_that_is_a_folder_is_refused_before_the_model_loads(command, option, name, tmp_path, fast_load):
    """--markdown or --plot naming a folder: the run went to its end, then died on IsADirectoryError."""
    folder = tmp_path / name
    folder.mkdir()
    refused([*TINY_EVALS[command], "-b", "50%", "-p", "h2o", option, str(folder)], option, "is a folder")
    assert fast_load == []


# -- bench and soak, refused before the model loads ----------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_bench_refuses_a_memory_limit_that_is_not_a_positive_finite_number(value, fast_load):
    refused(["bench", "--throughput", "--memory-limit", value], "--memory-limit", "positive finite number of GB")
    assert fast_load == []


@pytest.mark.parametrize(
    ("args", "said"),
    [(["--configs", "nope"], "unknown --prefill config 'nope'"), (["--chunk-size", "0"], "--chunk-size")],
)
def test_bench_prefill_settings_are_checked_before_the_model_loads(args, said, fast_load):
    refused(["bench", "--prefill", "--lengths", "8", *args], said)
    assert fast_load == []


def test_soak_refuses_too_few_tokens(fast_load):
    """One token has nothing to score: the soak had no window to report and ended on an IndexError."""
    refused(["soak", "--tokens", "1"], "--tokens must be at least 2")
    assert fast_load == []


def test_soak_refuses_a_text_it_would_ignore_or_cannot_read_before_the_model_loads(tmp_path, fast_load):
    missing = tmp_path / "missing.txt"
    refused(["soak", "--shape", "llama-tiny", "--text", str(missing)], "--text", "--shape")  # was ignored
    refused(["soak", "--text", str(missing)], "not found", str(missing))
    assert fast_load == []


# -- soak windows --------------------------------------------------------------------------------------------
def test_soak_windows_do_not_overlap(single_thread):
    """Each window names its own tokens (1-10, 11-20, 21-30), not 1-10, 10-20, 20-30; its perplexity is over
    the tokens it names that are scored (all but the text's first)."""
    model = tiny_model("llama", seed=3)
    ids = torch.randint(4, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    configs = soak_configs(8, 2)
    records = run_soak(model, ids, configs, window=10)
    assert [r["window"] for r in records] == [[1, 10], [11, 20], [21, 30]]
    nll, _ = ev.streaming_nll(model, ids, [c.policy for c in configs], [c.positions for c in configs])
    for r in records:
        first, last = r["window"]
        scored = nll[0, max(first, 2) - 2 : last - 1]  # nll[:, i] scores token i + 2 (counted from 1)
        assert r["ppl"]["absolute"] == pytest.approx(float(scored.mean().exp()), rel=1e-3)


# -- help ----------------------------------------------------------------------------------------------------
def test_eval_help_names_the_defaults_a_run_uses():
    recall = flat_help(["eval", "recall"])
    assert f"Default: {', '.join(rc.DEFAULT_POLICIES)}." in recall
    assert f"Default: the shipped {' and '.join(dl.RECALL_TEXTS)}." in recall
    for command in ("ppl", "needle", "agree"):
        assert f"Default: {', '.join(ev.DEFAULT_POLICIES)}." in flat_help(["eval", command])
    for command in ("needle", "agree"):
        assert f"Default: the shipped {' and '.join(ev.SHIPPED)}." in flat_help(["eval", command])


def test_bench_help_says_steps_are_rounded_to_its_rounds():
    from h2o_chat.measure.bench import run_decode_bench

    rounds = inspect.signature(run_decode_bench).parameters["rounds"].default
    assert f"in {rounds} rounds of equal size: rounded down to a multiple of {rounds} (at least {rounds})" in (
        flat_help(["bench"])
    )


# -- Ctrl-C keeps what was measured --------------------------------------------------------------------------
def interrupted_after(monkeypatch, owner, name: str, calls: int) -> None:
    """`owner.name` raises KeyboardInterrupt (a Ctrl-C) on its call number `calls + 1`."""
    original, seen = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        seen.append(1)
        if len(seen) > calls:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("json_out", [True, False])
def test_soak_interrupted_keeps_the_windows_it_finished(json_out, monkeypatch, tmp_path, single_thread):
    """Ctrl-C in the second window: stdout was empty (records printed only at the end); now the first window is
    written as it finishes (JSON), or its table under a note, and the exit is 130 with one line."""
    import json

    from h2o_chat.measure import soak

    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    interrupted_after(monkeypatch, soak, "process_memory", 1)
    args = ["soak", "--shape", "llama-tiny", "--tokens", "60", "--window", "20", "--budget", "8", "--threads", "1"]
    result = runner.invoke(cli.app, args + (["--json"] if json_out else []))
    assert result.exit_code == 130, (result.stderr, result.exception)
    assert result.stderr.splitlines()[-1] == "h2o-chat: interrupted (1 of 3 windows done)"
    if json_out:
        records = [json.loads(line) for line in result.stdout.splitlines()]
        assert [r["window"] for r in records] == [[1, 20]]
    else:
        assert "1-20" in result.stdout and "21-40" not in result.stdout
        assert result.stdout.splitlines()[-1] == "interrupted: 1 of 3 windows done"


@pytest.mark.parametrize("json_out", [True, False])
def test_bench_interrupted_keeps_the_lengths_it_finished(json_out, monkeypatch, tmp_path, single_thread):
    import json

    from h2o_chat.measure import bench

    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    original = bench._Measure.record

    def record(self, run, length):
        if length == 16:
            raise KeyboardInterrupt
        return original(self, run, length)

    monkeypatch.setattr(bench._Measure, "record", record)
    args = ["bench", "--shape", "llama-tiny", "--lengths", "8,16", "--steps", "6", "--configs", "full,h2o"]
    result = runner.invoke(cli.app, [*args, "--budget", "4", "--threads", "1"] + (["--json"] if json_out else []))
    assert result.exit_code == 130, (result.stderr, result.exception)
    assert result.stderr.splitlines()[-1] == "h2o-chat: interrupted (2 of 4 measurements done)"
    if json_out:
        records = [json.loads(line) for line in result.stdout.splitlines()]
        assert [(r["config"], r["measured_at"]) for r in records] == [("full", 8), ("h2o", 8), ("h2o@first", 8)]
    else:
        assert "ms/token" in result.stdout
        assert result.stdout.splitlines()[-1] == "interrupted: 2 of 4 measurements done"


def test_recall_interrupted_writes_the_conversations_it_finished(monkeypatch, tmp_path, fast_load, single_thread):
    """Ctrl-C in the second group: the first conversation's summaries go to stdout and --markdown (marked
    partial) instead of nothing."""
    import json

    interrupted_after(monkeypatch, rc, "_group", 1)
    md = tmp_path / "r.md"
    args = [*TINY_EVALS["recall"], "--conversations", "2", "--group", "1", "-b", "50%", "-p", "h2o"]
    result = runner.invoke(cli.app, [*args, "--answer-tokens", "2", "--json", "--markdown", str(md)])
    assert result.exit_code == 130, (result.stderr, result.exception)
    assert result.stderr.splitlines()[-1] == "h2o-chat: interrupted (1 of 2 conversations done)"
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["policy"] for r in records] == ["full", "without fact", "h2o"]
    assert all(r["conversations"] == 1 for r in records)
    assert "(interrupted: 1 of 2 conversations done)" in md.read_text(encoding="utf-8")


def test_ppl_interrupted_writes_every_row_over_the_tokens_scored(monkeypatch, fast_load, embedded, single_thread):
    """Ctrl-C in eval ppl lost everything (every row runs in one batch to the text's end): now every row's
    perplexity over the tokens the budgeted rows scored (the same as a run of that length), the full cache's
    over the same tokens; and each record says where and when it ran."""
    import json
    import math

    from h2o_chat.engine.step.decode import Engine

    args = ["eval", "ppl", "-b", "4", "-p", "h2o", "--json"]
    whole = [json.loads(line) for line in runner.invoke(cli.app, [*args, "--tokens", "5"]).stdout.splitlines()]
    interrupted_after(monkeypatch, Engine, "decode", 3)  # the 4th token scored, then the Ctrl-C
    result = runner.invoke(cli.app, [*args, "--tokens", "8"])
    assert result.exit_code == 130, (result.stderr, result.exception)
    assert result.stderr.splitlines()[-1] == "h2o-chat: interrupted (4 of 7 tokens scored)"
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["policy"], r["tokens"]) for r in records] == [("full", 5), ("h2o", 5)]
    assert records[1]["ppl"] == pytest.approx(whole[1]["ppl"], rel=1e-4)  # h2o's first 4 steps, as in a run of 5
    ids = torch.tensor([ev.token_ids(embedded.tokenizer, ev.read_text(None))[:8]])
    assert records[0]["ppl"] == pytest.approx(math.exp(float(ev.full_nll(embedded.model, ids)[:4].mean())), rel=1e-4)
    assert all(r["date"].startswith("20") and r["date"].endswith("UTC") and "torch" in r["machine"] for r in records)


@pytest.mark.parametrize("command", ["needle", "agree"])
def test_needle_and_agree_interrupted_write_the_groups_they_finished(command, monkeypatch, fast_load, single_thread):
    """Ctrl-C in eval needle or agree lost everything (all prompts were one batch): now a depth's trials (needle)
    or --group prompts (agree) are read together, and a Ctrl-C in the second writes the first's records."""
    import json

    interrupted_after(monkeypatch, ev, "greedy_rows", 3)  # a group: one call, then the full cache's and the rest's
    more = {"needle": ["--depth", "0.9"], "agree": ["--prompts", "2", "--group", "1"]}[command]
    args = [*TINY_EVALS[command], *more, "-b", "50%", "-p", "h2o", "--json"]
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 130, (result.stderr, result.exception)
    done = {"needle": "1 of 2 depths done", "agree": "1 of 2 prompts done"}[command]
    assert result.stderr.splitlines()[-1] == f"h2o-chat: interrupted ({done})"
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["policy"] for r in records] == ["full", "h2o"]
    if command == "needle":
        assert [(r["depth"], r["trials"]) for r in records] == [(0.5, 2), (0.5, 2)]
    else:
        assert [(r["prompts"], len(r["per_prompt"])) for r in records] == [(1, 1), (1, 1)]
        assert records[0]["rouge_l"] == 1.0  # the reference against itself
