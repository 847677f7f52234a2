"""The real command through Typer's CliRunner: piped prompts, --json, models, and every user error."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
    # the budget is full: the held tokens' keys and values, counted as a full cache counts them (issue 48.13)
    assert record["cache"]["kv_used_bytes"] * record["cache"]["seen"] == record["cache"]["full_kv_bytes"] * 32
    assert record["cache"]["evicted"] == record["cache"]["seen"] - 32
    assert record["generated_tokens"] <= 24 and record["finish_reason"] in ("stop", "length")
    assert record["decode"] == "eager"  # the embedded model on the CPU: eager steps
    # it runs from the GGUF's 4-bit weights, and says so with the bytes they hold (~141 MB, not fp32's 513)
    assert record["weights"]["format"].startswith("int4") and 100e6 < record["weights"]["bytes"] < 200e6


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
    # issue 48.13: it said the CPU runs float32; the embedded model runs from its GGUF's 4-bit weights there
    caption = " ".join(result.stdout.split())
    assert (
        "CPU runs float32" not in caption
        and "on a CPU a GGUF model (the embedded one) runs from its own 4-bit" in caption
    )
    assert "no" in next(line for line in result.stdout.splitlines() if line.startswith("llama-2-7b"))


def test_models_names_the_folder_weights_go_to_when_the_cache_cannot_be_written(monkeypatch):
    """H2O_CHAT_CACHE=/proc/nope: `models` named that folder, where nothing can be written; the weights go to a
    private temporary folder then (as the README says), and `models` says so."""
    from h2o_chat.files import writable_cache_dir

    monkeypatch.setenv("H2O_CHAT_CACHE", "/proc/h2o-chat-nope")
    caption = " ".join(invoke(["models"]).stdout.split())
    assert f"kept in {writable_cache_dir()} (/proc/h2o-chat-nope cannot be written" in caption, caption


@pytest.mark.parametrize("columns", ["80", "200"])
def test_models_shows_every_source_whole_on_one_line(columns):
    """Issue 21.1: what an 80-column terminal or a pipe gets, line by line (not flattened): no repo id is cut."""
    from h2o_chat.models.registry import load_registry

    result = runner.invoke(cli.app, ["models"], env={"COLUMNS": columns})
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines[:-2]) <= int(columns)
    for spec in load_registry().models.values():
        assert any(spec.source in line for line in lines), spec.source


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
        # issue 38.7: the option's name, not the policy's keyword
        (["--heavy-ratio", "1.0"], "hi", ["--heavy-ratio must be in [0, 1)", "got 1"]),
        (["--heavy-ratio", "2", "--policy", "h2o"], "hi", ["--heavy-ratio must be in [0, 1)", "got 2"]),
        (["-b", "6", "--policy", "sink", "--sinks", "8"], "hi", ["sink"]),
        (["--policy", "lru"], "hi", ["unknown policy", "h2o"]),
        (["--snap-window", "0"], "hi", ["snap window"]),
        (["-b", "64", "--snap-window", "64"], "hi", ["snap window", "budget (64)"]),
        (["--snap-kernel", "4"], "hi", ["pooling kernel", "odd"]),
        (["--quantize", "3bit"], "hi", ["--quantize must be none, 4bit or 8bit"]),
        (["--max-new-tokens", "0"], "hi", ["--max-new-tokens"]),
        (["--top-p", "0"], "hi", ["--top-p must be above 0 and at most 1, got 0"]),
        (["--temperature", "-0.5"], "hi", ["--temperature must be between 0 (greedy) and 10, got -0.5"]),
        # issue 22.17: non-finite and absurd values are refused like NaN
        (["--temperature", "inf"], "hi", ["--temperature must be between 0 (greedy) and 10, got inf"]),
        (["--temperature", "1e9"], "hi", ["--temperature must be between 0 (greedy) and 10, got 1e+09"]),
        (["--repetition-penalty", "inf"], "hi", ["--repetition-penalty must be above 0 and at most 10"]),
        (["--top-k", "-1"], "hi", ["--top-k must be a whole number >= 0"]),
        (["--min-p", "1.5"], "hi", ["--min-p must be at least 0 (off) and below 1, got 1.5"]),
        (["--threads", "0"], "hi", ["--threads must be a positive integer"]),
        # seeds are 31 bits: a larger one was folded onto a smaller one's draws without a word
        (["--seed", "2147483648"], "hi", ["--seed must be a whole number from 0 to 2147483647, got 2147483648"]),
        (["--stop", ""], "hi", ["--stop needs some text"]),
        (["--decode", "fast"], "hi", ["--decode must be one of auto, eager, graph, compile, got 'fast'"]),
        (["--kv-quant", "4bit"], "hi", ["--kv-quant must be none or 8bit, got '4bit'"]),
        (["--decode", "graph", "--device", "cpu"], "hi", ["--decode graph captures CUDA graphs"]),
        # issue 22.13: what is wrong with --budget 1 for snap is the budget, not the window
        (["-b", "1"], "hi", ["error: snap needs a budget of at least 2", "got 1"]),
        # issue 22.15: a file, a missing .gguf and an empty name each get their own reason
        (["-m", "/etc/passwd"], "hi", ["/etc/passwd is a file, not a model"]),
        (["-m", "/tmp/h2o-chat-missing.gguf"], "hi", ["GGUF file not found: /tmp/h2o-chat-missing.gguf"]),
        (["-m", "./no-such-model-folder"], "hi", ["model folder not found"]),
        (["-m", ""], "hi", ["--model is empty"]),
        ([], b"", ["stdin is empty"]),
        ([], b"   \n\t", ["stdin is empty"]),
        ([], b"caf\xe9 latin-1", ["not UTF-8", "0xe9"]),
        (["--models", "/nonexistent/models.toml"], "hi", ["models file not found"]),
        # issue 38.6: --budget was ignored without a word
        (["--kv-memory", "1GB", "--budget", "5"], "hi", ["--budget 5 and --kv-memory 1GB both set the budget"]),
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


def test_a_budget_beyond_memory_on_cpu_says_which_would_fit(fast_load, tmp_path):
    from conftest import tiny_model, tiny_tokenizer

    # tiny model: 512 bytes of KV a token, so 10^10 tokens is ~5 TB, which no test machine has; its trained
    # context is longer, so that the budget is not capped to it (issue 48.10)
    tiny_folder = tmp_path / "tiny-long"
    tiny_model("llama", max_positions=2**40).save_pretrained(tiny_folder)
    tiny_tokenizer().save_pretrained(tiny_folder)
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
    configs = {r["config"] for r in records} - {"llama.cpp"}  # its row: where llama-cpp-python is installed
    assert configs == {"dynamic", "full", "h2o", "h2o-nobound", "h2o@first"}
    h2o = [r for r in records if r["config"] == "h2o"]
    assert [r["seen"] for r in h2o] == [40, 80] and all(r["ms_per_token"] > 0 for r in records)
    full = {r["seen"]: r["kv_bytes"] for r in records if r["config"] == "dynamic"}
    assert full[80] > full[40] and h2o[0]["kv_bytes"] == h2o[1]["kv_bytes"]


def test_bench_prefill_times_every_reader_with_its_anchor(monkeypatch, tmp_path):
    """bench --prefill: transformers in one pass and in chunks beside full, h2o, snap and recall, in one run: seconds,
    tokens/s, extra peak memory, operators per layer; h2o's reading costs far fewer than the old 166."""
    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    args = ["bench", "--prefill", "--shape", "llama-tiny", "--lengths", "300", "--chunk-size", "64", "-b", "32"]
    result = invoke([*args, "--json"])
    assert result.exit_code == 0, result.stderr
    records = {r["config"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert list(records) == ["transformers", "transformers-chunked", "full", "h2o", "snap", "recall"]
    assert all(r["seconds"] > 0 and r["tokens_per_second"] > 0 and r["extra_peak_bytes"] > 0 for r in records.values())
    assert records["transformers"]["chunk"] is None and records["h2o"]["chunk"] == 64
    base = records["transformers-chunked"]["ops_per_layer"]
    assert base > 0 and records["h2o"]["ops_per_layer"] <= 1.5 * base and records["full"]["ops_per_layer"] <= 1.2 * base
    table = invoke([*args, "--configs", "transformers-chunked,recall"])  # --prefill's own configs
    assert table.exit_code == 0, table.stderr
    assert "recall / transformers-chunked: tokens/s" in table.stdout and "h2o /" not in table.stdout


def test_bench_without_llamacpp_says_how_to_get_its_row(fast_load, monkeypatch):
    from h2o_chat.measure import llamacpp

    monkeypatch.setattr(llamacpp, "installed", lambda: False)
    result = invoke(["bench", "--lengths", "40", "--budget", "32", "--steps", "2", "--configs", "llama.cpp,h2o"])
    assert_one_line_error(result, "pip install 'h2o-chat[llamacpp]'")  # asked for: one clear line
    result = invoke(["bench", "--lengths", "40", "--budget", "32", "--steps", "2", "--json"])
    assert result.exit_code == 0, result.stderr  # by default: the other rows, and a note on how to have it
    assert "no llama.cpp row" in result.stderr and "GGML_NATIVE=OFF" in result.stderr
    assert "llama.cpp" not in {json.loads(line)["config"] for line in result.stdout.splitlines()}


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_bench_times_llamacpp_on_the_same_gguf_in_the_same_rounds(fast_load):
    result = invoke(["bench", "--lengths", "40,80", "-b", "32", "--steps", "2", "--configs", "h2o,llama.cpp", "--json"])
    assert result.exit_code == 0, result.stderr
    rows = [r for r in map(json.loads, result.stdout.splitlines()) if r["config"] == "llama.cpp"]
    assert [r["seen"] for r in rows] == [40, 80] and all(r["ms_per_token"] > 0 and r["kv_bytes"] > 0 for r in rows)
    args = ["--lengths", "64", "--chunk-size", "32", "-b", "32", "--configs", "h2o,llama.cpp", "--json"]
    prefill = invoke(["bench", "--prefill", *args])
    assert prefill.exit_code == 0, prefill.stderr
    readers = {r["config"]: r for r in map(json.loads, prefill.stdout.splitlines())}
    assert readers["llama.cpp"]["tokens_per_second"] > 0 and readers["llama.cpp"]["prompt_tokens"] == 64


def test_bench_rejects_bad_lengths():
    assert_one_line_error(invoke(["bench", "--lengths", "512,abc"]), "--lengths")
    assert_one_line_error(invoke(["bench", "--configs", "h2o,fast"]), "unknown bench config")
    assert_one_line_error(invoke(["bench", "--prefill", "--configs", "h2o,fast"]), "unknown --prefill config")


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


def test_version():
    result = invoke(["--version"])
    from h2o_chat import __version__

    assert result.exit_code == 0 and result.stdout == f"h2o-chat {__version__}\n"


def test_help_states_the_defaults_truly():
    """Issue 22.18: llama.cpp's repeat penalty is 1.0 (off), ollama's 1.1; issue 18: rolling positions number
    tokens by their rank among the held tokens, not by cache slot."""
    text = " ".join(invoke(["--help"]).stdout.replace("│", " ").split())
    assert "1 = off, llama.cpp's default; ollama's is 1.1" in text
    assert "by cache slot" not in text and "rank among the held tokens" in text


def test_download_without_network_is_one_line(fast_load):
    """Issue 22.3: the Hub's connection error (HF_HUB_OFFLINE here, as without network) is one line."""
    result = invoke(["-m", "h2o-chat-tests/not-a-real-model", "--download"], "hi")
    assert_one_line_error(result, "could not download h2o-chat-tests/not-a-real-model from the Hugging Face Hub")


def test_a_file_that_is_not_gguf_is_refused_before_converting(fast_load, tmp_path):
    """Issue 22.4: `head -c 1000 /bin/ls > fake.gguf`, and an empty .gguf: one line, no "converting" first."""
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(Path(sys.executable).resolve().read_bytes()[:1000])
    assert_one_line_error(invoke(["-m", str(fake)], "hi"), "is not a GGUF model")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_one_line_error(invoke(["-m", str(empty)], "hi"), "is empty, not a GGUF model")
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + bytes(60))
    # a GGUF header: its conversion starts (and says so: the budget is checked against the model's trained context,
    # which its config gives), then fails on one line
    from h2o_chat.models import loading
    from h2o_chat.models.registry import load_registry

    cut = tmp_path / "cut.gguf"  # a partial download: the embedded model's first megabyte (inside its header)
    with open(loading.embedded_gguf(load_registry().resolve(None).source), "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    for path in (damaged, cut):  # the second was the GGUF reader's struct.error, a traceback
        result = invoke(["-m", str(path)], "hi")
        assert result.exit_code != 0 and "Traceback" not in result.output
        lines = result.stderr.splitlines()
        assert lines[-1].startswith("h2o-chat: error: cannot convert"), lines
        assert all("converting" in line for line in lines[:-1]), lines


@pytest.mark.parametrize(
    "entry, fragments",
    [
        ("source = 3", ["models.mine.source must be a string, got 3"]),
        ('source = "a/b"\ncontext = -5', ["models.mine.context must be a positive number of tokens, got -5"]),
        ('source = "a/b"\ncontext = true', ["models.mine.context"]),
        ('source = "a/b"\nnote = 1', ["models.mine.note must be a string"]),
        ('source = "a/b"\ndtype = "float8"', ["models.mine.dtype must be one of"]),
        ('family = "llama"', ["models.mine has no source"]),
    ],
)
def test_a_wrong_value_in_models_toml_names_alias_and_field(fast_load, tmp_path, entry, fragments):
    """Issue 22.5."""
    user = tmp_path / "models.toml"
    user.write_text(f"[models.mine]\n{entry}\n")
    assert_one_line_error(invoke(["--models", str(user), "-m", "mine"], "hi"), str(user), *fragments)


def test_piped_text_follows_a_prompt_argument(fast_load, embedded):
    """Issue 22.9: `cat notes.txt | h2o-chat "Summarise:"` reads both, the argument first."""
    args = ["--raw", "--json", "--max-new-tokens", "1", "--temperature", "0"]
    both = json.loads(invoke([*args, "Summarise in one word:"], "The cat sat on the mat.").stdout)
    expected = embedded.tokenizer("Summarise in one word:\n\nThe cat sat on the mat.")["input_ids"]
    assert both["prompt_tokens"] == len(expected)
    alone = json.loads(invoke([*args, "Summarise in one word:"], "").stdout)  # nothing piped: the argument
    assert alone["prompt_tokens"] == len(embedded.tokenizer("Summarise in one word:")["input_ids"])
    assert_one_line_error(invoke([*args, "Summarise:"], b"caf\xe9"), "stdin is not UTF-8")


def test_ctrl_c_during_json_writes_a_partial_record(fast_load, monkeypatch):
    """Issue 22.10: Ctrl-C in --json mode still writes the record, with finish_reason "interrupted"."""
    from h2o_chat.engine.step import generate

    real, seen = generate.StreamingDetokenizer.add, []

    def add(self, token):
        seen.append(token)
        if len(seen) == 4:
            raise KeyboardInterrupt
        return real(self, token)

    monkeypatch.setattr(generate.StreamingDetokenizer, "add", add)
    result = invoke(["--json", "--temperature", "0", "--max-new-tokens", "30"], "Count from one to ten.")
    assert result.exit_code == 130 and "interrupted" in result.stderr
    record = json.loads(result.stdout)
    assert record["finish_reason"] == "interrupted" and record["text"] and record["generated_tokens"] == 3


def test_ctrl_c_while_the_prompts_last_chunk_is_read_ends_as_interrupted(fast_load, monkeypatch):
    """Ctrl-C during the prompt's last chunk (or its only one): the conversation keeps the message read whole and
    ends the turn before its first token, so the piped run had no reply to report and died in a traceback. It
    is an interrupted run: one line, status 130, and with --json a record saying so."""
    import contextlib

    from h2o_chat.engine.step import prefill

    monkeypatch.setattr(prefill, "deferred_interrupt", lambda: contextlib.nullcontext(lambda: True))  # Ctrl-C hit
    for args in (["--json"], []):
        result = invoke([*args, "--temperature", "0", "--max-new-tokens", "8"], "Count from one to ten.")
        assert result.exit_code == 130 and "Traceback" not in result.output, result.output
        assert result.stderr.strip().splitlines()[-1] == "h2o-chat: interrupted", result.stderr
    record = json.loads(invoke(["--json", "-n", "8"], "Count from one to ten.").stdout)
    assert record["finish_reason"] == "interrupted" and record["generated_tokens"] == 0 and record["text"] == ""


def test_stop_strings_end_the_reply(fast_load):
    """Issue 22.20: --stop (repeatable) ends the reply before the first one."""
    args = ["--json", "--temperature", "0", "--max-new-tokens", "16", "What is the capital of France?"]
    full = json.loads(invoke(args).stdout)["text"]
    assert "Paris" in full
    cut = json.loads(invoke([*args, "--stop", "zzz", "--stop", "Paris"]).stdout)
    assert cut["finish_reason"] == "stop" and cut["text"] == full[: full.index("Paris")]


def test_top_k_and_min_p_on_the_command_line(fast_load):
    """Issue 22.20: --top-k 1 (or a min-p that keeps only the most likely token) samples the greedy reply."""
    args = ["--json", "--max-new-tokens", "12", "What is the capital of France?"]
    greedy = json.loads(invoke([*args, "--temperature", "0"]).stdout)["text"]
    assert json.loads(invoke([*args, "--temperature", "1.5", "--top-k", "1"]).stdout)["text"] == greedy
    assert json.loads(invoke([*args, "--temperature", "1.5", "--min-p", "0.999"]).stdout)["text"] == greedy


def test_threads_sets_torch_cpu_threads(fast_load):
    """Issue 22.20: --threads N for torch on the CPU."""
    import torch

    before = torch.get_num_threads()
    try:
        result = invoke(["--threads", "1", "--max-new-tokens", "2", "--temperature", "0"], "Hi")
        assert result.exit_code == 0, result.stderr
        assert torch.get_num_threads() == 1
        # more threads than CPUs only wait for each other (1000 on 2 cores: 0.4 tok/s): at most the CPUs, said
        cpus = len(os.sched_getaffinity(0))
        result = invoke(["--threads", str(cpus + 3), "--max-new-tokens", "2", "--temperature", "0"], "Hi")
        assert result.exit_code == 0 and torch.get_num_threads() == cpus, result.stderr
        assert f"--threads {cpus + 3}: this process may run on {cpus} CPUs; using {cpus}" in result.stderr
    finally:
        torch.set_num_threads(before)


def test_plurals_and_the_budget_note_names_the_option(fast_load):
    """Issue 22.19: "1 token", not "1 tokens"; a piped note suggests --budget, which exists there (not /budget)."""
    result = invoke(["--temperature", "0", "--max-new-tokens", "1", "-b", "16"], "Tell me about boxes. " * 40)
    assert result.exit_code == 0, result.stderr
    summary = result.stderr.splitlines()[-1]
    assert summary.startswith("h2o-chat: 1 token, ") and not re.search(r"\b1 tokens", result.stderr)
    note = result.stderr.splitlines()[0]
    assert "(--budget)" in note and "/budget" not in note


def test_a_slow_prompt_is_forecast_before_it_is_read(fast_load, monkeypatch):
    """Issue 21.3: a prompt that will take over a minute to read gets one note up front: tokens, time, advice."""
    from h2o_chat.app import piped

    monkeypatch.setattr(piped, "SLOW_READING", 0.0)  # any reading is "slow" here
    result = invoke(["--temperature", "0", "--max-new-tokens", "1", "--chunk-size", "32", "-b", "64"], "Box. " * 60)
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "will take about" in line]
    assert len(notes) == 1 and "a larger --chunk-size, or a GPU, reads faster" in notes[0]
    found = re.search(
        r"reading ([\d,]+) tokens \(twice: snap's probe reads the prompt first\) will take about .+ at", notes[0]
    )
    assert found, notes[0]  # the probe reads the whole prompt (issue 41.7), then the prompt is read again


def test_sigpipe_ends_quietly():
    """Issue 22.19: `h2o-chat ... | head -c 20` ends as other tools do (SIGPIPE), without a word on stderr."""
    from test_chat import _installed_command

    proc = subprocess.Popen(
        [*_installed_command(), "--temperature", "0", "--max-new-tokens", "64", "Count from one to fifty."],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    head = proc.stdout.read(20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, -13, 141) and len(head) == 20
    assert "Traceback" not in err and "error" not in err


def test_a_failed_write_to_stdout_is_one_line_for_every_command(tmp_path):
    """Issue 38.4: `echo hi | h2o-chat --max-new-tokens 3 > /dev/full` ended in a 42-line traceback. A write to
    stdout that fails (not the reader going away: that stays quiet) is one line, exit 1, whatever wrote it."""
    from test_chat import _installed_command

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "Say hi.", "max_new_tokens": 2}\n')
    for args in (["--max-new-tokens", "3"], ["models"], ["--help"], ["batch", str(inp), "-o", "-"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [*_installed_command(), *args], input="hi", stdout=full, stderr=subprocess.PIPE, text=True, timeout=300
            )
        last = done.stderr.splitlines()[-1:]
        assert done.returncode == 1 and last == ["h2o-chat: cannot write to stdout: No space left on device"], args
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_a_closed_stdout_is_one_line_for_every_command(tmp_path):
    """Issue 48.7: `h2o-chat "Hi" >&-` ended in two tracebacks ('NoneType' object has no attribute 'write', then
    'flush'). A command that writes its results to stdout says so on one line, exit 1, before loading a model;
    batch with -o FILE writes nothing there and runs (no file it opens takes stdout's descriptor)."""
    from test_chat import _installed_command

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "Say hi.", "max_new_tokens": 2}\n')
    closed = ["sh", "-c", 'exec "$@" >&-', "sh", *_installed_command()]
    for args in (
        ["--max-new-tokens", "2", "Hi"],
        ["--json", "--max-new-tokens", "2", "Hi"],
        ["models"],
        ["list"],
        ["batch", str(inp), "-o", "-"],
    ):
        done = subprocess.run([*closed, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
        assert (done.returncode, done.stderr) == (1, "h2o-chat: cannot write to stdout: it is closed\n"), args
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [*closed, "batch", str(inp), "-o", str(out), "--temperature", "0"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert json.loads(out.read_text())["id"] == "a"


def test_soak_help_names_the_text_option_a_file():
    """Issue 22.19: soak --text took a path but showed <str>."""
    text = invoke(["soak", "--help"]).stdout
    line = next(line for line in text.splitlines() if "--text" in line)
    assert "FILE" in line and "<str>" not in line and "TEXT" not in line.split("--text")[1][:8]


def test_bench_prints_no_line_its_table_lacks(fast_load):
    """Issue 22.19: the h2o twin parked at the first length serves a ratio, not a row: no line of its own."""
    result = invoke(["bench", "--lengths", "40,80", "--budget", "32", "--steps", "2", "--configs", "h2o"])
    assert result.exit_code == 0, result.stderr
    assert "h2o@first" not in result.output and "h2o 32 / " not in result.stderr
    assert "seen" in result.stdout


def test_a_setup_notice_starts_its_own_line_on_the_terminal(embedded, monkeypatch):
    """Issue 22.11: on a terminal shared by stdout and stderr, a capture announced after the first tokens is
    not glued to the reply; its seconds are reported apart, not folded into tok/s."""
    import io
    import time

    from h2o_chat.app.chat.conversation import ChatSettings
    from h2o_chat.app.piped import RunOptions, run_piped
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.step.decode import Engine
    from h2o_chat.engine.step.sampling import Sampler

    class Screen(io.StringIO):
        def isatty(self):
            return True

    real = Engine.decode

    def decode(self, tokens=None):
        if not self.captures:
            self.captures = 1
            self.on_setup("capturing the decode step as a CUDA graph (once)")
            time.sleep(2.0)
            self.setup_seconds += 2.0
        return real(self, tokens)

    monkeypatch.setattr(Engine, "decode", decode)
    screen = Screen()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    settings = ChatSettings(max_new_tokens=8, sampler=Sampler(0))
    started = time.monotonic()
    record = run_piped(embedded, RunOptions(make_policy("h2o", 64), settings, json=False), "Count to five.")
    wall = time.monotonic() - started
    lines = screen.getvalue().splitlines()
    assert "h2o-chat: capturing the decode step as a CUDA graph (once) ..." in lines  # a whole line
    assert record["setup_seconds"] >= 2.0
    # the 2 s are not in the speed: the decode time the speed implies fits in the run's time less the 2 s (with
    # them it would not, however slow the machine): a check of the accounting, not of the machine's speed
    decode_time = (record["generated_tokens"] - 1) / record["decode_tps"]
    assert decode_time + 2.0 <= wall + 0.05, (decode_time, wall)
    assert "one-time setup 2." in " ".join(screen.getvalue().split())  # the summary, wrapped to the terminal


def test_reading_forecast():
    """Issue 21.3: one note when the reading speed projects over a minute; none for a quick prompt. The speed is
    the second chunk's: the first pays one-time costs (a forecast from it said 7 min for a read of 2)."""
    from h2o_chat.app.piped import ReadingForecast

    now = [0.0]
    forecast = ReadingForecast(clock=lambda: now[0])
    assert forecast(0, 20_000, 20_000) is None
    now[0] = 40.0  # the first chunk: 512 tokens in 40 s, warming up
    assert forecast(512, 20_000, 20_000) is None
    now[0] = 80.0  # the second: 512 tokens in 40 s, 12.8 tok/s: 80 s + 18,976 tokens at that speed
    note = forecast(1024, 20_000, 20_000)
    assert note.startswith("reading 20,000 tokens will take about 26 min at 13 tok/s")
    assert forecast(1536, 20_000, 20_000) is None  # said once
    warm = ReadingForecast(clock=lambda: now[0])
    warm(0, 20_000, 20_000)
    now[0] += 10.0  # a slow first chunk (51 tok/s: 6.5 min), then a fast one: no note (all read in 48 s)
    assert warm(512, 20_000, 20_000) is None
    now[0] += 1.0
    assert warm(1024, 20_000, 20_000) is None
    quick = ReadingForecast(clock=lambda: now[0])
    quick(0, 2048, 2048)
    now[0] += 1.0
    quick(512, 2048, 2048)
    now[0] += 1.0
    assert quick(1024, 2048, 2048) is None


def test_a_prompt_too_big_for_memory_is_read_in_smaller_chunks_or_refused(fast_load, embedded, monkeypatch):
    """Issue 17.4: the prompt's reading is checked against free memory before it starts (its transients
    included): a smaller chunk when that fits, with a note; otherwise one line and nothing read."""
    from h2o_chat.models import memory
    from h2o_chat.models.memory import ModelShape, prefill_bytes

    def free(limit):
        monkeypatch.setattr(memory, "available_bytes", lambda device: limit)

    shape = ModelShape.of(embedded.model.config)
    prompt = " ".join(["The mill wheel turned slowly in the brown water."] * 60)  # ~700 tokens
    need = prefill_bytes(shape, 4, 1, 64, 512, mass=True)
    free(int(1.2 * prefill_bytes(shape, 4, 1, 64, 64, mass=True)))  # room for a chunk of 64, not of 512
    assert need > 1.2 * prefill_bytes(shape, 4, 1, 64, 64, mass=True)
    result = invoke(["--temperature", "0", "--max-new-tokens", "4", "-b", "64", "-p", "h2o", prompt])
    assert result.exit_code == 0, result.stderr
    assert "reading in chunks of 64 tokens instead of 512" in result.stderr
    free(1000)
    result = invoke(["--max-new-tokens", "4", "-b", "64", "-p", "h2o", prompt])
    assert result.exit_code != 0 and "Traceback" not in result.output and not result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("h2o-chat: error:")]
    assert len(errors) == 1 and "MB is available; lower --budget (or /budget)" in errors[0]


@pytest.mark.parametrize(
    ("text", "size"),
    [("256MB", 256 * 2**20), ("1.5GB", 3 * 2**29), ("1.5 GiB", 3 * 2**29), ("512k", 2**19), ("4096", 4096),
     ("10b", 10), (".5m", 2**19)],
)  # fmt: skip
def test_sizes_are_read_in_the_units_h2o_chat_prints(text, size):
    from h2o_chat.app.budget import parse_size

    assert parse_size("--kv-memory", text) == size


def test_the_kv_memory_sets_the_budget_it_holds_as_the_cache_stores_it(fast_load, embedded, tmp_path):
    """--kv-memory: the budget is the most tokens whose keys and values, as --kv-quant stores them, fit in the
    memory given (for all batch rows together); the cache then allocates no more than that. Bad sizes are one
    line each, before anything loads."""
    text = embedded.model.config
    # a token's slot in every layer and KV head: fp32 keys and values (D = 64), position and rotation (int64),
    # score (fp32): `slots.slot_bytes`, the one formula
    per_token = text.num_hidden_layers * text.num_key_value_heads * (2 * 64 * 4 + 8 + 8 + 4)
    memory = 3 * 2**20
    budget = memory // per_token
    result = invoke(["--kv-memory", "3MB", "--max-new-tokens", "4", "--temperature", "0"], "Say hi.")
    assert result.exit_code == 0, result.stderr
    assert f"--kv-memory 3MB: a budget of {budget} tokens ({per_token:,} bytes a token)" in result.stderr
    summary = result.stderr.strip().splitlines()[-1]
    assert f"cache snap {budget} (" in summary
    allocated = float(re.search(r"KV ([\d.]+) MB allocated", summary).group(1))
    assert budget * per_token / 2**20 - 0.1 <= allocated <= 3.0  # the budget it holds, within the memory given
    result = invoke(["--kv-memory", "3MB", "--kv-quant", "8bit", "--max-new-tokens", "2"], "Say hi.")
    eight = int(re.search(r"a budget of (\d+) tokens", result.stderr).group(1))
    # int8 keys and values with a float16 scale each, the same position, rotation and score
    eight_per_token = text.num_hidden_layers * text.num_key_value_heads * (2 * 64 + 2 * 2 + 8 + 8 + 4)
    assert result.exit_code == 0 and eight == memory // eight_per_token
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "Say hi."}\n{"id": 2, "prompt": "Name a colour."}\n')
    out = tmp_path / "out.jsonl"
    args = ["batch", str(inp), "-o", str(out), "--kv-memory", "3MB", "--batch-size", "2", "--max-new-tokens", "2"]
    result = invoke(args)
    assert result.exit_code == 0, result.stderr
    assert f"a budget of {memory // (2 * per_token)} tokens for each of 2 rows" in result.stderr
    assert {json.loads(x)["cache"]["budget"] for x in out.read_text().splitlines()} == {memory // (2 * per_token)}
    for bad, words in (
        ("3XB", "must be a size such as 256MB"),
        ("0MB", "more than 0 bytes"),
        ("100", "holds no token"),
    ):
        assert_one_line_error(invoke(["--kv-memory", bad], "hi"), "--kv-memory", words)


@pytest.mark.parametrize(
    ("args", "error", "command"),
    [
        (["batch", "in.jsonl"], "Missing option '--output' / '-o' (see", " batch"),
        (["models", "extra"], "Got unexpected extra argument(s) (extra)", " models"),
        (["--nope"], "No such option: --nope", ""),
        (["eval", "ppl", "--tokens", "x"], "Invalid value for '--tokens'", " eval ppl"),
        (["bench", "--steps", "many"], "Invalid value for '--steps'", " bench"),
    ],
)
def test_usage_errors_are_one_plain_line(args, error, command):
    """Issue 38.5: Typer's boxed usage errors broke the promise of one line on stderr; then the error and where
    the help is took two lines; now one, plain, exit 2."""
    result = invoke(args, "hi")
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"h2o-chat: error: {error}"), result.stderr
    assert re.search(rf" \(see '\S+{command} --help'\)$", lines[0]), lines[0]  # the program's name: the runner's


def test_budget_takes_tokens_a_memory_or_a_share_of_the_trained_context(fast_load, embedded, tmp_path):
    """Issue 38.5: --budget 64MB and --budget 10% were usage errors while /budget 64MB worked in the chat. Now
    --budget reads what /budget reads: a memory as --kv-memory does, a share of the trained context (8,192 here),
    and says what it came to; a number without a unit is a whole number of tokens."""
    text = embedded.model.config
    # a token's slot in every layer and KV head: fp32 keys and values (D = 64), position and rotation (int64),
    # score (fp32): `slots.slot_bytes`, the one formula
    per_token = text.num_hidden_layers * text.num_key_value_heads * (2 * 64 * 4 + 8 + 8 + 4)
    for given, tokens, how in (
        ("64MB", 64 * 2**20 // per_token, f"({per_token:,} bytes a token)"),
        ("10%", 819, "(10% of the trained context, 8,192)"),
        ("300", 300, None),
    ):
        result = invoke(["--budget", given, "--max-new-tokens", "2", "--temperature", "0", "--json"], "Say hi.")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["cache"]["budget"] == tokens
        said = f"h2o-chat: --budget {given}: a budget of {tokens:,} tokens {how}"
        assert (said in result.stderr) if how else ("a budget of" not in result.stderr)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "Say hi."}\n')
    out = tmp_path / "out.jsonl"
    result = invoke(["batch", str(inp), "-o", str(out), "-b", "5%", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(out.read_text())["cache"]["budget"] == 410
    for bad, words in (
        ("2.5", "--budget 2.5: a number of tokens is a whole number, and a memory needs its unit (e.g. 2.5MB)"),
        ("lots", "--budget takes a number of tokens (512), a memory (64MB) or a share of the trained context (10%)"),
        ("0%", "a percentage budget must be above 0%"),
        ("0MB", "--budget must be more than 0 bytes"),
        ("1KB", "--budget 1KB holds no token"),
    ):
        assert_one_line_error(invoke(["--budget", bad], "hi"), words)


def test_options_before_a_command_are_honoured_or_refused(fast_load, tmp_path):
    """Issue 38.6: `h2o-chat --models m1.toml models` ignored --models; it now lists that file's aliases too. The
    chat's options before another command's name, which it would ignore as silently, are refused."""
    extra = tmp_path / "m1.toml"
    extra.write_text('[models.my-tiny]\nsource = "/nonexistent/tiny"\nfamily = "llama"\n')
    result = invoke(["--models", str(extra), "models"])
    assert result.exit_code == 0 and any(line.startswith("my-tiny ") for line in result.stdout.splitlines())
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    result = invoke(["--budget", "5", "--models", str(extra), "batch", str(inp), "-o", str(tmp_path / "o.jsonl")])
    assert_one_line_error(result, "--models, --budget before 'batch' would be ignored: put them after it")
    assert fast_load == [] and not (tmp_path / "o.jsonl").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_json_and_raw_in_a_terminal_say_what_they_need(tmp_path):
    """Issue 38.6: `h2o-chat --json --raw` in a terminal started the chat and ignored both; now one line says
    they need piped input or a prompt argument, before anything loads."""
    from test_chat import Pty

    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color", XDG_DATA_HOME=str(tmp_path))
    term = Pty(["--json", "--raw"], env, 24, 200)
    try:
        assert term.read_until(b"the interactive chat takes neither", 60), term.screen[-2000:]
        _, status = os.waitpid(term.pid, 0)
    except BaseException:
        term.close()
        raise
    assert os.waitstatus_to_exitcode(status) == 2
    text = term.screen.decode().replace("\r\n", "\n").strip()
    assert text == (
        'h2o-chat: error: --json and --raw need piped input or a prompt argument (h2o-chat --json --raw "PROMPT"); '
        "the interactive chat takes neither"
    )


def test_an_architecture_it_does_not_run_or_a_broken_config_is_one_line_before_anything_loads(tmp_path):
    """BLOOM and MPT read the prompt and then crashed in the attention's routing, T5 crashed after its tokenizer
    loaded, GPT-2 ran with no word and failed past its context naming OPT, and a config.json that is not JSON
    was a traceback: each is refused from its config, before the tokenizer or the weights load."""
    from transformers import AutoConfig

    from conftest import tiny_tokenizer

    for kind in ("bloom", "t5", "gpt2"):
        folder = tmp_path / kind
        AutoConfig.for_model(kind).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        result = invoke(["-m", str(folder), "--device", "cpu"], "hi")
        assert_one_line_error(result, f"is a {kind} model, which h2o-chat does not run", "llama, mistral")
        inp = tmp_path / "in.jsonl"
        inp.write_text('{"id": 1, "prompt": "w5 w6"}\n')
        result = invoke(["batch", str(inp), "-o", str(tmp_path / "out.jsonl"), "-m", str(folder), "--device", "cpu"])
        assert_one_line_error(result, f"is a {kind} model")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    tiny_tokenizer().save_pretrained(broken)
    assert_one_line_error(invoke(["-m", str(broken), "--device", "cpu"], "hi"), "cannot read", "config")


REFUSES_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
)


def test_a_chat_template_that_refuses_the_conversation_is_one_line_in_the_cli_and_a_400_in_the_server(tmp_path):
    """Templates that refuse a system prompt (Gemma's, older Mistral-Instruct's) raised jinja's TemplateError
    through every front end: a traceback after the weights loaded; in the server, a 500."""
    from conftest import tiny_model, tiny_tokenizer
    from h2o_chat.app.serve.api import ApiError, Limits, parse_request
    from h2o_chat.app.serve.sessions import SessionStore, plan_turn

    folder = tmp_path / "no-system"
    tiny_model("llama").save_pretrained(folder)
    tok = tiny_tokenizer()
    tok.chat_template = REFUSES_SYSTEM
    tok.save_pretrained(folder)
    result = invoke(["-m", str(folder), "--device", "cpu", "--system", "Be terse.", "-n", "2"], "w5")
    assert_one_line_error(result, "the chat template refuses this conversation: System role not supported")
    assert invoke(["-m", str(folder), "--device", "cpu", "-n", "2"], "w5").exit_code == 0
    body = {"messages": [{"role": "system", "content": "w5"}, {"role": "user", "content": "w6"}]}
    with pytest.raises(ApiError, match="System role not supported") as caught:
        plan_turn(SessionStore(8, 1 << 30), parse_request(body, "chat", Limits()), tok, 1000)
    assert caught.value.status == 400


def test_a_reply_that_reaches_a_learned_context_ends_there_whole_piped_and_in_batch(tmp_path):
    """OPT's learned positions end at its trained context: a reply asked to run past it stopped with an error in
    the middle (--json: stdout empty, the tokens generated lost), and in batch one such line ended the whole run
    (a rerun died on it again). Now it ends at the context with finish_reason "length" and a note, and the
    other lines run."""
    from conftest import tiny_model, tiny_tokenizer

    folder = tmp_path / "tiny-opt"
    tiny_model("opt", max_positions=32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    args = ["-m", str(folder), "--device", "cpu", "--temperature", "0", "--ignore-eos"]
    result = invoke([*args, "-n", "200", "--json"], "w5 w6 w7")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    prompt = record["prompt_tokens"]
    assert record["finish_reason"] == "length" and record["generated_tokens"] == 32 - prompt + 1
    assert "at the model's trained context (32 tokens)" in result.stderr
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": "w5 w6", "max_new_tokens": n}) + "\n"
                           for i, n in enumerate((5, 200, 5, 5))))  # fmt: skip
    out = tmp_path / "out.jsonl"
    result = invoke(["batch", str(inp), "-o", str(out), *args, "--batch-size", "1"])
    assert result.exit_code == 0, result.stderr
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == [0, 1, 2, 3] and records[1]["finish_reason"] == "length"
    assert [records[i]["generated_tokens"] for i in (0, 2, 3)] == [5, 5, 5] and records[1]["generated_tokens"] < 32


def test_a_small_learned_context_model_quantizes_to_4bit_on_cpu(tmp_path):
    """The 4-bit packing calibrates the LM head on a 512-token text: a model whose learned positions end sooner
    (an OPT of 32) failed there with an IndexError traceback; it calibrates within its context now."""
    from conftest import tiny_model, tiny_tokenizer
    from h2o_chat.models.loading import cpu_kernels

    if not cpu_kernels():
        pytest.skip("the 4-bit CPU kernels are not built here")
    folder = tmp_path / "tiny-opt"
    tiny_model("opt", max_positions=32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    result = invoke(["-m", str(folder), "--device", "cpu", "--quantize", "4bit", "-n", "2", "--json"], "w5 w6")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["generated_tokens"] >= 1


def test_rolling_positions_on_opt_are_refused_before_the_weights_load(tmp_path):
    """OPT's positions are learned: --positions rolling was refused only after loading (and quantizing) the
    weights, minutes for opt-6.7b. The family tells before anything loads: one line, nothing said before it."""
    from conftest import tiny_model, tiny_tokenizer

    folder = tmp_path / "tiny-opt"
    tiny_model("opt", max_positions=32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    for command in ([], ["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]):
        (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "w5"}\n')
        args = [*command, "-m", str(folder), "--device", "cpu", "--positions", "rolling", "--quantize", "8bit"]
        assert_one_line_error(invoke(args, "w5"), "--positions rolling needs rotary position embeddings", "(OPT)")
