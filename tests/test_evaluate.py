"""Evaluation: streaming perplexity equals a one-pass forward, needle and agreement end to end, the eval CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from h2o_chat.app import cli
from h2o_chat.engine.policies import make_policy
from h2o_chat.errors import ConfigError
from h2o_chat.measure import evaluate as ev
from h2o_chat.measure import plots, tasks
from h2o_chat.measure.bench import attention

runner = CliRunner()


def budgets(*texts: str) -> list[ev.BudgetSpec]:
    return [ev.BudgetSpec.parse(t) for t in texts]


# -- pure parts ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, n, tokens", [("256", 1000, 256), ("20%", 2048, 410), ("5%", 2048, 102), ("100%", 300, 300), (" 7 ", 9, 7)]
)
def test_budget_in_tokens_or_percent(text, n, tokens):
    assert ev.BudgetSpec.parse(text).tokens(n) == tokens


@pytest.mark.parametrize("text", ["abc", "0", "0%", "150%", "-5", "12.5", "%", "nan%", ""])
def test_impossible_budgets_are_config_errors(text):
    with pytest.raises(ConfigError, match="budget"):
        ev.BudgetSpec.parse(text)


def test_configs_put_the_full_cache_first_and_resolve_percentages():
    configs = ev.make_configs(["h2o", "sink", "full", "h2o"], budgets("10%", "64"), 1000)
    assert [c.label for c in configs] == ["full", "h2o 100", "h2o 64", "sink 100", "sink 64"]
    assert [c.budget_pct for c in configs] == [None, 10.0, 6.4, 10.0, 6.4]
    assert [c.spec for c in configs] == [None, "10%", "64", "10%", "64"]
    with pytest.raises(ConfigError, match="positions"):
        ev.make_eval_cache(tiny_model(), [configs[0].policy], positions="sideways")


def test_rouge_l_is_lcs_f1():
    assert tasks.rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert tasks.rouge_l([1, 2], [3, 4]) == 0.0
    p, r = 3 / 5, 3 / 4  # LCS [1, 3, 5]
    assert tasks.rouge_l([1, 2, 3, 4, 5], [1, 3, 5, 6]) == pytest.approx(2 * p * r / (p + r))
    assert tasks.rouge_l([], []) == 1.0 and tasks.rouge_l([], [1]) == 0.0


def test_needle_goes_between_sentences():
    text = "One two. Three four. Five six. Seven eight."
    assert tasks.hide(text, "X.", 0).startswith("X. One") and tasks.hide(text, "X.", 1).endswith("eight. X.")
    middle = tasks.hide(text, "X.", 0.5)
    assert "six. X.  Seven" in middle and middle.replace(" X. ", "", 1) == text


# -- perplexity through the cache ----------------------------------------------------------------------------
def test_streaming_perplexity_equals_one_pass_forward(embedded):
    model, tok = embedded.model, embedded.tokenizer
    n = 64
    ids = torch.tensor([ev.token_ids(tok, ev.read_text())[:n]])
    results = ev.perplexity(model, ids, ev.make_configs(["h2o"], budgets("200", "25%"), n))
    with attention(model, "sdpa"), torch.inference_mode():
        nll = F.cross_entropy(model(ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
    full, roomy, small = results
    assert full.config.label == "full" and full.tokens == n
    assert full.ppl == pytest.approx(math.exp(float(nll.mean())), rel=5e-3)
    torch.testing.assert_close(full.nll, nll, atol=2e-3, rtol=2e-3)
    # nothing evicted: the same model, token by token; the packed linears return bfloat16, which a step (one row)
    # and a chunk round differently: ~1% of these 64 tokens' perplexity (1e-5 with float32 weights)
    rel = 1e-5 if embedded.quantize == "none" else 2e-2
    assert roomy.config.label == "h2o 200" and roomy.ppl == pytest.approx(full.ppl, rel=rel)
    assert small.config.label == "h2o 16" and small.kept == 16 and small.ppl > full.ppl
    assert len(full.window_ppl(25)) == 3 and full.record()["window_ppl"] == [round(full.ppl, 3)]


def test_full_cache_nll_in_chunks_equals_one_pass(single_thread):
    """The full cache's perplexity is computed from chunked forwards; a chunk boundary must predict the next
    chunk's first token, and the prompt's tokens are left out as streaming_nll leaves them out."""
    model = tiny_model("llama", seed=4)
    ids = torch.randint(4, 256, (1, 53))
    with torch.inference_mode():
        whole = F.cross_entropy(model(ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
    for chunk in (8, 16, 52, 53, 512):
        torch.testing.assert_close(ev.full_nll(model, ids, chunk=chunk), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ev.full_nll(model, ids, prompt_tokens=10, chunk=16), whole[9:], atol=1e-4, rtol=1e-4)
    calls = []
    (alone,) = ev.perplexity(model, ids, ev.make_configs([], [], 53), progress=lambda d, t: calls.append((d, t)))
    assert alone.config.label == "full" and calls[-1] == (53, 53)  # a full-only run still ends its bar
    torch.testing.assert_close(alone.nll, whole, atol=1e-4, rtol=1e-4)
    streamed, _ = ev.streaming_nll(model, ids, [make_policy("full")], prompt_tokens=10)
    torch.testing.assert_close(streamed[0], whole[9:], atol=1e-4, rtol=1e-4)


# -- greedy rows, needle and agreement -----------------------------------------------------------------------
def test_measurement_loops_report_progress_to_the_last_token(single_thread):
    from h2o_chat.measure.bench import run_decode_bench
    from h2o_chat.measure.soak import run_soak, soak_configs

    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()

    def recorder():
        calls = []
        return calls, lambda done, total: calls.append((done, total))

    ids = torch.randint(4, 256, (1, 40))
    calls, progress = recorder()
    ev.streaming_nll(model, ids, [make_policy("snap", 16)], progress=progress, prompt_tokens=24)
    assert calls[-1] == (40, 40) and calls == sorted(calls) and calls[0][0] <= 24  # the prompt, then token by token
    calls, progress = recorder()
    ev.greedy_rows(
        model, tok, [ids[0, :30].tolist()], ev.make_configs(["h2o"], budgets("16"), 30), 5, 8, progress=progress
    )
    # the full cache runs as its own batch (1 row of 2), then the budgeted rows: each counts its share of a column
    assert calls[-1] == (35, 35) and calls == sorted(calls) and {t for _, t in calls} == {35}
    assert (17, 35) in calls  # half way when the full batch ends
    calls, progress = recorder()
    run_soak(model, torch.randint(4, 256, (1, 30)), soak_configs(8, 2), window=10, progress=progress)
    assert calls[-1] == (30, 30)
    calls, progress = recorder()
    lines = []
    run_decode_bench(
        model, None, [16, 24], 8, ("full", "h2o"), steps=2, rounds=1, chunk=8, status=lines.append, progress=progress
    )
    assert calls[-1][0] == calls[-1][1] and calls == sorted(calls)  # every token the runs feed, counted ahead
    assert len(lines) == 6 and "ms/token" in lines[0]  # measurements stay status lines


def test_the_bench_says_how_its_steps_ran(single_thread, monkeypatch):
    """A compiled step whose package was not built yet ran eagerly in the bench (no build started, none waited
    for) and its figures were labelled compiled: h2o-8bit on CPU read 36 ms/token "(compile)" against 10.5 once
    built. The bench now builds the step before timing it; one that cannot be built falls back to eager steps,
    and the row says eager."""
    from h2o_chat.engine.step import compiled
    from h2o_chat.measure.bench import run_decode_bench

    asked = []

    def cannot_build(*args, **kwargs):
        asked.append(1)
        raise RuntimeError("no compiler in this test")

    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    monkeypatch.setattr(compiled, "unavailable", lambda: None)  # auto resolves to compile
    monkeypatch.setattr(compiled, "ready", lambda *a: False)  # no package on disk
    monkeypatch.setattr(compiled, "program", cannot_build)
    lines: list[str] = []
    model = tiny_model("llama", seed=3)
    records = run_decode_bench(model, None, [16], 8, ("h2o-8bit",), steps=2, rounds=1, chunk=8, status=lines.append)
    assert asked, "the bench timed eager steps without asking for the compiled one"
    assert [r.decode for r in records] == ["eager"] and "(eager," in lines[-1], lines


def test_an_evaluation_has_its_compiled_step_built_and_keeps_its_figures(single_thread, monkeypatch):
    """`h2o-chat eval` ran every step eagerly where the step's package was not built (its engines had no builder):
    2x slower for hours of evaluation. Its engines now ask the model's `step_builder` (set by the command) for a
    build in the background, once per kind, and decode eagerly meanwhile with the same figures."""
    from h2o_chat.engine.step import compiled

    model = tiny_model("llama", seed=3)
    ids = torch.randint(4, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    policies = [make_policy("h2o", 16), make_policy("full")]
    plain, _ = ev.streaming_nll(model, ids, policies, prompt_tokens=8, decode="eager")
    asked: list = []
    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    monkeypatch.setattr(compiled, "unavailable", lambda: None)  # auto resolves to compile
    monkeypatch.setattr(compiled, "ready", lambda *a: False)  # no package on disk
    model.step_builder = asked.append
    nll, _ = ev.streaming_nll(model, ids, policies, prompt_tokens=8)
    assert [type(kind).__name__ for kind in asked] == ["StepKind"]  # asked once, for the step's kind
    assert torch.equal(nll, plain)  # eager steps meanwhile: the same figures


def test_batched_rows_equal_separate_runs():
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    prompts = [torch.randint(4, 256, (n,)).tolist() for n in (20, 33)]
    configs = ev.make_configs(["h2o", "sink"], budgets("16"), 33)
    together = ev.greedy_rows(model, tok, prompts, configs, 12)
    for p, prompt in enumerate(prompts):
        alone = ev.greedy_rows(model, tok, [prompt], configs, 12)
        assert [rows[p] for rows in together] == [rows[0] for rows in alone]


def test_agreement_with_room_is_identical_to_full():
    model, tok = tiny_model("llama", seed=5), tiny_tokenizer()
    texts = {"a": " ".join(f"w{4 + i % 250}" for i in range(400)), "b": " ".join(f"w{9 + i % 90}" for i in range(300))}
    prompts = tasks.agree_prompts(tok, texts, n=3, prompt_tokens=60)
    assert [name for name, _ in prompts] == ["a@0", "a@170", "b@0"]
    configs = ev.make_configs(["h2o", "recent"], budgets("100", "10%"), 80)
    records = tasks.agreement(model, tok, prompts, configs, max_new_tokens=16)
    by = {(r["policy"], r["budget"]): r for r in records}
    assert by["full", None]["rouge_l"] == 1.0 and by["h2o", 100]["rouge_l"] == 1.0 and by["h2o", 100]["identical"] == 3
    assert by["h2o", 100]["same_prefix"] == by["full", None]["generated"]
    assert all(0.0 <= r["rouge_l"] <= 1.0 and len(r["per_prompt"]) == 3 for r in records)


def test_embedded_model_finds_the_needle_with_the_full_cache(embedded):
    tok = embedded.tokenizer
    trials = tasks.needle_trials(tok, {"alice.txt": ev.read_text()}, [0.5], haystack_tokens=200, seed=1)
    records = tasks.needle(embedded.model, tok, trials, ev.make_configs(["h2o"], budgets("100%"), 300))
    assert [r["accuracy"] for r in records] == [1.0, 1.0], records
    answer = records[0]["answers"][0]
    assert answer["code"] in answer["answer"] and len(answer["code"]) == 4


# -- the CLI -------------------------------------------------------------------------------------------------
def invoke(*args: str):
    return runner.invoke(cli.app, ["eval", *args])


def test_ppl_command_json_table_plot_and_markdown(fast_load, tmp_path, capsys):
    png, md = tmp_path / "ppl.png", tmp_path / "ppl.md"
    result = invoke(
        "ppl",
        "--tokens",
        "24",
        "-b",
        "50%",
        "-b",
        "18",
        "-p",
        "h2o",
        "--json",
        "--plot",
        str(png),
        "--markdown",
        str(md),
    )
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["policy"], r["budget"], r["budget_pct"]) for r in records] == [
        ("full", None, None),
        ("h2o", 12, 50.0),
        ("h2o", 18, 75.0),
    ]
    assert all(r["tokens"] == 24 and r["ppl"] > 1 and r["text"] == "alice.txt" for r in records)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "| h2o |" in md.read_text() and "50% (12)" in md.read_text()
    (tmp_path / "ppl.json").write_text(result.stdout)
    plots.main(["ppl", str(tmp_path / "ppl.json")])  # re-rendered from the saved records
    assert capsys.readouterr().out == md.read_text()
    table = invoke("ppl", "--tokens", "8", "-b", "6", "-p", "recent")
    assert table.exit_code == 0 and "full (reference)" in table.stdout and "6 (75%)" in table.stdout


def test_ppl_with_8bit_storage_says_so_and_scores_like_float(fast_load):
    runs = {}
    for quant in ("none", "8bit"):
        result = invoke("ppl", "--tokens", "40", "-b", "16", "-p", "h2o", "--kv-quant", quant, "--json")
        assert result.exit_code == 0, result.stderr
        runs[quant] = {r["policy"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert runs["8bit"]["h2o"]["kv_quant"] == "8bit" and runs["none"]["h2o"]["kv_quant"] == "none"
    assert runs["8bit"]["full"]["ppl"] == runs["none"]["full"]["ppl"]  # the reference is never quantized
    assert runs["8bit"]["h2o"]["ppl"] == pytest.approx(runs["none"]["h2o"]["ppl"], rel=0.05)
    table = invoke("ppl", "--tokens", "8", "-b", "6", "-p", "recent", "--kv-quant", "8bit")
    assert table.exit_code == 0 and "budgeted rows hold keys and values in 8 bits" in table.stdout


def test_needle_and_agree_commands_end_to_end_on_a_tiny_model(fast_load, tiny_folder, tmp_path):
    heat = tmp_path / "needle.png"
    common = ["--model", str(tiny_folder), "-b", "50%", "-p", "h2o", "-p", "sink", "--json"]
    result = invoke(
        "needle", "--haystack-tokens", "60", "--depth", "0.2", "--depth", "0.8", *common, "--plot", str(heat)
    )
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["policy"], r["depth"]) for r in records] == [(p, d) for p in ("full", "h2o", "sink") for d in (0.2, 0.8)]
    for r in records:
        assert r["trials"] == 2 and {a["haystack"] for a in r["answers"]} == set(ev.SHIPPED)
        hits = [a["code"] in a["answer"] for a in r["answers"]]  # the score is what the answers say
        assert [a["correct"] for a in r["answers"]] == hits and r["accuracy"] == sum(hits) / 2 == r["correct"] / 2
    assert heat.read_bytes()[:4] == b"\x89PNG"
    snap = ["-p", "snap", "--snap-window", "4", "--snap-kernel", "3"]
    result = invoke("agree", "--prompts", "2", "--prompt-tokens", "50", "--tokens", "8", *common, *snap)
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["policy"] for r in records] == ["full", "h2o", "sink", "snap"] and records[0]["rouge_l"] == 1.0
    bad = invoke("agree", "--prompts", "2", "--prompt-tokens", "50", *common, "-p", "snap", "--snap-kernel", "2")
    assert bad.exit_code != 0 and "odd" in bad.stderr and "Traceback" not in bad.stderr


def test_eval_help_imports_no_torch():
    code = (
        "import sys, h2o_chat.app.cli as c\ntry:\n    c.app(['eval', 'ppl', '--help'])\nexcept SystemExit:\n    pass\n"
    )
    code += "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("NO-TORCH") and "--budget" in out.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["ppl", "--text", "/nonexistent/book.txt"], "text file not found"),
        (["ppl", "-b", "abc"], "budget must be a number"),
        (["ppl", "-b", "0"], "budget must be a positive"),
        (["ppl", "-b", "0%"], "percentage budget"),
        (["ppl", "-b", "150%"], "percentage budget"),
        (["ppl", "-b", "3", "-p", "sink"], "sink"),
        (["ppl", "-p", "lru"], "unknown policy"),
        (["ppl", "--positions", "sideways"], "--positions"),
        (["ppl", "--tokens", "1"], "--tokens"),
        (["ppl", "--plot", "out.gif"], "--plot"),
        (["ppl", "--markdown", "/nonexistent/dir/ppl.md"], "output folder"),
        (["needle", "--depth", "1.5"], "--depth"),
        (["needle", "-b", "150%"], "percentage budget"),
        (["needle", "--haystack", "/nonexistent/hay.txt"], "text file not found"),
        (["agree", "-b", "abc"], "budget must be a number"),
        (["agree", "--tokens", "0"], "--tokens"),
    ],
)
def test_bad_input_gets_one_clear_line(fast_load, args, fragment):
    result = invoke(*args)
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2o-chat: error:") and fragment in lines[0], result.stderr
    assert fast_load == []  # rejected before any weights load


def test_empty_text_file(fast_load, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    result = invoke("agree", "--text", str(empty))
    assert result.exit_code != 0 and result.stderr.strip() == f"h2o-chat: error: text file is empty: {empty}"


def test_ppl_after_a_compressed_prompt(embedded):
    """--prompt-tokens: the first tokens are one prompt (snap compresses it), the rest are scored."""
    model = embedded.model
    ids = torch.tensor([ev.token_ids(embedded.tokenizer, ev.read_text())[:80]])
    configs = ev.make_configs(["h2o", "snap"], [ev.BudgetSpec.parse("24")], 80)
    results = ev.perplexity(model, ids, configs, prompt_tokens=64)
    assert [r.tokens for r in results] == [80, 80, 80] and all(r.nll.numel() == 16 for r in results)
    full, h2o, snap = (r.ppl for r in results)
    assert full < 1.5 * min(h2o, snap) and h2o != snap  # snap chose different prompt tokens than h2o
    with attention(model, "sdpa"), torch.inference_mode():  # the full cache: one forward over the whole text
        nll = F.cross_entropy(model(ids).logits[0, 63:-1].float(), ids[0, 64:], reduction="none")
    torch.testing.assert_close(results[0].nll, nll, atol=2e-3, rtol=2e-3)


def test_a_long_evaluation_says_how_long_it_will_take(monkeypatch, capsys):
    """Issue 21: once the first steps are timed, one line says the speed and the time left; the bar sees every
    call; nothing is said twice."""
    import time

    from h2o_chat.app import evalcli

    clock = iter(float(t) for t in range(0, 1000, 2))  # two seconds per call
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    seen = []
    progress = evalcli.forecast(lambda d, t: seen.append((d, t)), "ppl", 9, "token")
    for done in range(0, 641, 10):
        progress(done, 640)
    lines = [line for line in capsys.readouterr().err.splitlines() if "left" in line]
    # 2 s per 10 tokens after the first 10 (>= 640 // 64 = 10): 0.20 s per token, 630 tokens to go = 126 s
    assert lines == ["h2o-chat: ppl: 0.20 s per token for 9 rows together; about 2 min left"]
    assert seen == [(d, 640) for d in range(0, 641, 10)]
    progress = evalcli.forecast(lambda d, t: None, "recall", None)
    for done in range(0, 641, 10):
        progress(done, 640)
    assert [line for line in capsys.readouterr().err.splitlines() if "left" in line] == [
        "h2o-chat: recall: about 2 min left"
    ]
