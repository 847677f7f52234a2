"""The real command through Typer's CliRunner: piped prompts, --json, models, and every user error."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from h2o_chat.app import cli

runner = CliRunner()


def invoke(args, stdin: bytes | str = b""):
    return runner.invoke(cli.app, args, input=stdin)


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2o-chat: error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_help_is_fast_and_imports_no_torch():
    code = "import sys, h2o_chat.app.cli as c\ntry:\n    c.app(['--help'])\nexcept SystemExit:\n    pass\n"
    code += "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("NO-TORCH"), out.stdout[-200:]
    assert "--budget" in out.stdout


@pytest.mark.parametrize("command", [[], ["batch"], ["bench"], ["soak"], ["models"], ["eval", "ppl"]])
def test_help_shows_no_type_after_flags_and_no_stray_text(command):
    result = invoke([*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout and "--no-" not in result.stdout.replace("--no-panel", "")
    text = " ".join(result.stdout.replace("│", " ").split())  # the help as one line, borders and wraps gone
    assert not re.search(r"\s\.(\s|$)", text), text  # a markup-eaten "[default: ...]" left " ." behind
    if not command:
        assert "choose what it keeps (default 16, at most a quarter of the budget)" in text
        assert "H2O_CHAT_CACHE" in text


def test_piped_prompt_streams_only_text_to_stdout(fast_load):
    result = invoke(["--temperature", "0", "--max-new-tokens", "16", "-b", "32"], "What is the capital of France?")
    assert result.exit_code == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" not in result.stdout
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("h2o-chat:") and "snap 32 (16 heavy + 16 recent)" in summary and "evicted" in summary


def test_a_prompt_argument_gets_one_reply(fast_load):
    result = invoke(["--temperature", "0", "--max-new-tokens", "16", "-b", "32", "What is the capital of France?"], "")
    assert result.exit_code == 0, result.stderr  # stdin (empty here) is not read
    assert "Paris" in result.stdout and "tok/s" in result.stderr
    result = invoke(["What", "is", "the", "capital", "of", "France?", "--json", "--temperature", "0", "-b", "32"])
    assert result.exit_code == 0, result.stderr  # options after the words, words unquoted
    record = json.loads(result.stdout)
    assert "Paris" in record["text"] and record["cache"]["budget"] == 32
    assert invoke(["models"]).stdout.startswith("alias")  # a subcommand's name still runs the subcommand
    assert_one_line_error(invoke([""]), "the prompt is empty")


def test_piped_json_record(fast_load):
    result = invoke(["--temperature", "0", "--max-new-tokens", "24", "-b", "32", "--json"], "Count from one to ten.")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["model"] == "smollm2-135m" and record["text"]
    assert '"kept": 32,' in result.stdout and '"evicted": 32.0' not in result.stdout  # whole means as integers
    assert record["cache"]["kept"] == 32 and record["cache"]["seen"] > 32
    # the budget is full: every slot but the spare one a decode step writes into
    assert record["cache"]["kv_used_bytes"] == record["cache"]["kv_bytes"] * 32 // 33
    assert record["cache"]["evicted"] == record["cache"]["seen"] - 32
    assert record["generated_tokens"] <= 24 and record["finish_reason"] in ("stop", "length")
    assert record["decode"] == "eager"  # the embedded model on the CPU: eager steps


def test_piped_prompt_far_beyond_the_budget_gets_a_note_first(fast_load):
    result = invoke(["--temperature", "0", "--max-new-tokens", "2", "-b", "16"], "Tell me about boxes. " * 40)
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("h2o-chat: note: the prompt is") and "budget of 16" in lines[0]
    assert "reading" not in result.stderr  # stderr is not a terminal here: no progress bar


def test_raw_mode_continues_plain_text(fast_load):
    result = invoke(["--raw", "--temperature", "0", "--max-new-tokens", "8", "--json"], "Once upon a time")
    record = json.loads(result.stdout)
    assert record["prompt_tokens"] == 4  # no chat template around it


def test_models_lists_aliases_and_presence():
    result = invoke(["models"])
    assert result.exit_code == 0
    for alias in ("smollm2-135m", "llama-2-7b", "opt-6.7b", "pythia-6.9b", "mistral-7b"):
        assert alias in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("smollm2-135m"))
    assert row.startswith("smollm2-135m *") and "yes" in row
    assert "no" in next(line for line in result.stdout.splitlines() if line.startswith("llama-2-7b"))


def test_models_keeps_whole_repo_ids_at_80_columns(monkeypatch, tmp_path):
    from h2o_chat.models.registry import load_registry

    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path / "weights"))
    result = runner.invoke(cli.app, ["models"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "…" not in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()[:-2]) <= 80
    flat = "".join(result.stdout.split())  # a folded id continues on the next line, the other columns blank
    for spec in load_registry().models.values():
        assert spec.source in flat, spec.source
    assert f"{tmp_path / 'weights'}(H2O_CHAT_CACHEsetsanotherfolder)" in flat


@pytest.mark.parametrize(
    "args, stdin, fragments",
    [
        (["-m", "llama2-7b"], "hi", ["unknown model", "llama-2-7b"]),
        (["-m", "llama-2-7b"], "hi", ["not on this machine", "--download"]),
        (["-b", "0"], "hi", ["budget must be a positive"]),
        (["-b", "-3"], "hi", ["budget must be a positive"]),
        (["--heavy-ratio", "1.0"], "hi", ["heavy_ratio"]),
        (["-b", "6", "--policy", "sink", "--sinks", "8"], "hi", ["sink"]),
        (["--policy", "lru"], "hi", ["unknown policy", "h2o"]),
        (["--snap-window", "0"], "hi", ["snap window"]),
        (["-b", "64", "--snap-window", "64"], "hi", ["snap window", "budget (64)"]),
        (["--snap-kernel", "4"], "hi", ["pooling kernel", "odd"]),
        (["--quantize", "4bit", "--device", "cpu"], "hi", ["--quantize 4bit needs a CUDA GPU"]),
        (["--max-new-tokens", "0"], "hi", ["--max-new-tokens"]),
        (["--top-p", "0"], "hi", ["--top-p must be above 0 and at most 1, got 0"]),
        (["--temperature", "-0.5"], "hi", ["--temperature must be >= 0 (0 = greedy), got -0.5"]),
        ([], b"", ["stdin is empty"]),
        ([], b"   \n\t", ["stdin is empty"]),
        ([], b"caf\xe9 latin-1", ["not UTF-8", "0xe9"]),
        (["--models", "/nonexistent/models.toml"], "hi", ["models file not found"]),
    ],
)
def test_bad_input_gets_one_clear_line(fast_load, args, stdin, fragments):
    assert_one_line_error(invoke(args, stdin), *fragments)


def test_unwritable_cache_folder_falls_back_to_a_temporary_one(tmp_path, monkeypatch, embedded):
    import tempfile

    from h2o_chat import files
    from h2o_chat.models import loading
    from h2o_chat.models.registry import load_registry

    gguf = loading.embedded_gguf(load_registry().resolve(None).source)
    converted = loading.converted_folder(gguf)  # the session's own conversion (the embedded fixture made it)
    blocker = tmp_path / "home-is-a-file"  # as root, permission bits stop nothing: a file in the path does
    blocker.write_text("")
    monkeypatch.delenv("H2O_CHAT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(files, "_fallback", {})
    fallback = files.writable_cache_dir()
    assert fallback.parent == tmp_path / "tmp" and fallback.stat().st_mode & 0o777 == 0o700
    (fallback / "converted").mkdir()
    (fallback / "converted" / converted.name).symlink_to(converted)  # as if converted there by an earlier run
    monkeypatch.setattr(files, "_fallback", {})

    result = invoke(["-m", "smollm2-135m", "--temperature", "0", "--max-new-tokens", "4"], "Say hi.")
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.output and result.stdout.strip()
    notes = [line for line in result.stderr.splitlines() if str(blocker / "cache") in line]
    assert len(notes) == 1 and f"converted weights are cached in {fallback}" in notes[0]


def test_a_budget_beyond_memory_on_cpu_says_which_would_fit(fast_load, tiny_folder, tmp_path):
    # tiny model: 512 bytes of KV a token, so 10^10 tokens is ~5 TB, which no test machine has
    result = invoke(["-m", str(tiny_folder), "--device", "cpu", "-b", "10000000000"], "hi")
    assert_one_line_error(result, "10000000000-token KV cache", "memory available", "--budget")
    budget = int(re.search(r"--budget (\d+) fits", result.stderr).group(1))
    assert 64 <= budget < 10_000_000_000
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "w5 w6"}\n')
    args = ["batch", str(inp), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_folder), "--device", "cpu"]
    result = invoke([*args, "-b", "1000000000", "--batch-size", "8"])
    assert_one_line_error(result, "for each of 8 rows", "with 8 rows (--batch-size)")
    per_row = int(re.search(r"--budget (\d+) fits", result.stderr).group(1))
    assert abs(per_row * 8 - budget) < 0.2 * budget  # batch sizes by budget x rows (free memory drifts a bit)


def test_a_model_folder_without_a_tokenizer(fast_load, tiny_folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tiny_folder / name).unlink(missing_ok=True)
    result = invoke(["-m", str(tiny_folder)], "hi")
    assert_one_line_error(result, str(tiny_folder), "no tokenizer", "tokenizer.json")


def test_malformed_models_file(fast_load, tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text("[models.x\nsource=")
    assert_one_line_error(invoke(["--models", str(bad)], "hi"), "not valid TOML")
    bad.write_bytes(b"\xff\xfe")
    assert_one_line_error(invoke(["--models", str(bad)], "hi"), "cannot read models file")


def test_cuda_device_without_gpu(fast_load):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert_one_line_error(invoke(["-m", "smollm2-135m", "--device", "cuda"], "hi"), "no CUDA GPU")


def test_bench_command_small(fast_load):
    result = invoke(["bench", "--lengths", "40,80", "--budget", "32", "--steps", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    configs = {r["config"] for r in records}
    assert configs == {"dynamic", "full", "h2o", "h2o-nobound", "h2o@first"}
    h2o = [r for r in records if r["config"] == "h2o"]
    assert [r["seen"] for r in h2o] == [40, 80] and all(r["ms_per_token"] > 0 for r in records)
    full = {r["seen"]: r["kv_bytes"] for r in records if r["config"] == "dynamic"}
    assert full[80] > full[40] and h2o[0]["kv_bytes"] == h2o[1]["kv_bytes"]


def test_bench_rejects_bad_lengths():
    assert_one_line_error(invoke(["bench", "--lengths", "512,abc"]), "--lengths")
    assert_one_line_error(invoke(["bench", "--configs", "h2o,fast"]), "unknown bench config")


def test_option_groups_are_declared_once_and_shared():
    """--model, --device, ... come from one ModelOptions declaration in every command that loads a model; a
    command can change a group's defaults (batch samples greedily) without declaring the options again."""
    import click
    import typer.main

    from h2o_chat.app.options import ModelOptions, SamplingOptions

    root = typer.main.get_command(cli.app)
    ctx = click.Context(root)
    commands = {
        "main": root,
        "batch": root.get_command(ctx, "batch"),
        "bench": root.get_command(ctx, "bench"),
        "soak": root.get_command(ctx, "soak"),
        **{f"eval {n}": root.get_command(ctx, "eval").get_command(ctx, n) for n in ("ppl", "needle", "agree")},
    }
    model_options = [f.name for f in dataclasses.fields(ModelOptions)]
    helps = {}
    for name, command in commands.items():
        params = {p.name: p for p in command.params}
        assert set(model_options) <= set(params), name
        for option in model_options:
            helps.setdefault(option, set()).add(params[option].help)
    assert all(len(h) == 1 for h in helps.values())  # one declaration, one help text
    main = {p.name: p.default for p in commands["main"].params}
    batch = {p.name: p.default for p in commands["batch"].params}
    assert (main["temperature"], batch["temperature"]) == (SamplingOptions().temperature, 0.0)
    assert (main["max_new_tokens"], batch["max_new_tokens"]) == (512, 256)
