"""Batch mode: malformed lines, results written as rows finish, kill and resume, rows equal to solo runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from h2o_chat.app import cli
from h2o_chat.app.batch.run import Defaults, Summary, finished_ids, generate_batch, read_items
from h2o_chat.engine.policies import make_policy

runner = CliRunner()


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_malformed_lines_are_reported_and_the_rest_run(fast_load, tmp_path):
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "a", "prompt": "What is the capital of France?"},
            "{not json",
            {"id": "b", "messages": [{"role": "user", "content": "Say hi."}], "max_new_tokens": 4},
            {"id": "a", "prompt": "duplicate"},
            {"id": "c", "prompt": "x", "budget": 0},
            {"id": "d", "prompt": "x", "temperature": -1},
            {"id": "e", "messages": [{"role": "robot", "content": "x"}]},
            {"id": "f", "prompt": "Name a fruit.", "budget": 16, "temperature": 0.7},
            {"prompt": "no id"},
            {"id": "g", "prompt": "x", "budget": 1},  # valid JSON, but snap cannot split one slot
        ],
    )
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out), "--max-new-tokens", "12", "-b", "48"])
    assert result.exit_code == 4, result.stderr  # every valid row finished; the skipped ones were reported (38.7)
    lines = result.stderr.splitlines()
    skipped = [line for line in lines if line.startswith("h2o-chat: skipped")]
    assert [s.split(" line ")[1].split(":")[0] for s in skipped] == ["2", "4", "5", "6", "7", "9", "10"]
    assert "not valid JSON" in skipped[0] and 'duplicate id "a"' in skipped[1] and "budget" in skipped[2]
    first_row = next(i for i, line in enumerate(lines) if line.startswith(("h2o-chat: a:", "h2o-chat: b:")))
    assert lines.index(skipped[-1]) < first_row  # reported before generation started, not at the end
    assert "3 done, 0 already in out.jsonl, 7 lines skipped (listed above; exit status 4) |" in lines[-1]
    assert "Traceback" not in result.output
    got = {r["id"]: r for r in records(out)}
    assert set(got) == {"a", "b", "f"}
    assert "Paris" in got["a"]["text"] and got["b"]["generated_tokens"] <= 4
    assert got["f"]["cache"]["budget"] == 16 and got["a"]["cache"]["budget"] == 48
    for r in got.values():
        assert r["cache"]["kept"] <= r["cache"]["budget"] and r["seconds"] > 0


def test_batch_shows_its_progress_in_tokens_of_every_lines_allowance(fast_load, tmp_path, monkeypatch):
    """A batch said nothing between finished lines (minutes, for long ones): now a bar on a terminal, a line a
    minute elsewhere (here every step), counting the tokens of every line's max_new_tokens; a line that ends
    early counts the rest of its allowance, so the count ends at the total."""
    from h2o_chat.app import ui
    from h2o_chat.app.batch import run

    monkeypatch.setattr(ui, "LOG_EVERY", 0.0)
    told: list[tuple[int, int]] = []
    original = run.run_batch

    def run_batch(*args, progress, **kwargs):
        def both(done, total):
            told.append((done, total))
            progress(done, total)

        return original(*args, progress=both, **kwargs)

    monkeypatch.setattr(run, "run_batch", run_batch)
    lines = [
        {"id": "a", "prompt": "Say hi.", "max_new_tokens": 48},  # ends by itself (29 tokens)
        {"id": "b", "prompt": "Count to twenty.", "max_new_tokens": 6},
        {"id": "c", "prompt": "Name a fruit.", "max_new_tokens": 5},
    ]
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out),
                                     "--batch-size", "2", "--temperature", "0"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert told[-1] == (59, 59) and all(t == 59 for _, t in told)
    assert [d for d, _ in told] == sorted({d for d, _ in told})  # rises at every step, never twice the same
    shown = [line for line in result.stderr.splitlines() if line.startswith("h2o-chat: batch, ")]
    assert len(shown) >= 20 and shown[0].startswith("h2o-chat: batch, 0 lines done: 2/59 (3%), about ")
    assert any(line.startswith("h2o-chat: batch, 2 lines done: ") for line in shown)
    assert {r["id"]: r["generated_tokens"] for r in records(out)}["a"] < 48


def test_ids_come_back_as_given_and_a_rerun_skips_them(fast_load, tmp_path):
    """Issue 48.12: an integer id came back as a string ("id": 1 -> "1"); a user's data comes back as given, and a
    rerun knows the rows it finished whatever the ids' type (1 and "1" are different ids, as in JSON)."""
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": 1, "prompt": "Say hi.", "max_new_tokens": 2},
            {"id": "1", "prompt": "Say bye.", "max_new_tokens": 2},
            {"id": 1, "prompt": "again"},
        ],
    )
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 4, result.stderr
    assert "line 3: duplicate id 1" in result.stderr
    assert sorted((r["id"] for r in records(out)), key=str) == [1, "1"]
    assert [type(r["id"]) for r in records(out) if r["id"] == 1] == [int]
    again = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert "0 done, 2 already in out.jsonl" in again.stderr and len(records(out)) == 2


def test_input_file_errors(fast_load, tmp_path):
    result = runner.invoke(cli.app, ["batch", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "input file not found" in result.stderr
    # `-` is not standard input (as -o - is stdout): said, not "not found"
    result = runner.invoke(
        cli.app, ["batch", "-", "-o", str(tmp_path / "o.jsonl")], input='{"id": 1, "prompt": "hi"}\n'
    )
    assert result.exit_code == 2 and "batch reads its lines from a file, not standard input" in result.stderr
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(tmp_path / "no" / "dir" / "o.jsonl")])
    assert result.exit_code == 2 and "output folder does not exist" in result.stderr
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.stderr and "Traceback" not in result.output
    assert result.stderr.count("\n") == 1
    (tmp_path / "link.jsonl").symlink_to(inp)
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(tmp_path / "link.jsonl")])
    assert result.exit_code == 2 and "is the input file" in result.stderr
    assert inp.read_text() == '{"id": 1, "prompt": "hi"}\n'
    (tmp_path / "all-bad.jsonl").write_text("{oops\n[1]\n")
    result = runner.invoke(cli.app, ["batch", str(tmp_path / "all-bad.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "no line of all-bad.jsonl can be run" in result.stderr.splitlines()[-1]
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe{}")
    result = runner.invoke(cli.app, ["batch", str(tmp_path / "bin.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "not UTF-8" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("policy", ["h2o", "recall"])
def test_a_prompt_refilled_into_a_row_reads_as_it_does_alone(embedded, prompt_ids, policy):
    """Continuous batching's promise, at the logits: a prompt read into a row that another left (`refill`) gives
    the logits it gives read alone, bit for bit, while the other row holds its own conversation. recall's did not
    (0.31 apart): a fresh cache skipped ranking the store in its first chunk, where a refilled row ranked an empty
    one (the same attention over a different shape); `H2OCache.stored_before` now decides it for both."""
    import torch

    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.step.decode import Engine

    model = embedded.model
    mine, other = prompt_ids("Write one sentence about rain."), prompt_ids("Name three animals.")
    alone = Engine(model, H2OCache.for_model(model, [make_policy(policy, 40)]), "eager")
    want = alone.prefill(torch.tensor([mine]))[0]
    batch = Engine(model, H2OCache.for_model(model, [make_policy(policy, 40)] * 2), "eager")
    batch.prefill(torch.tensor([other, other]))
    batch.cache.clear_row(1)  # as `refill` reads it, returning the logits rather than a token
    ids = torch.tensor([mine])
    view = batch.cache.row(1)
    got = batch._read(view, ids, torch.ones_like(ids), None, None)
    batch.cache.absorb(view, 1)
    assert torch.equal(got[0], want)
    # and decoding on: recall's refilled row was fitted to its empty store before its prompt (arbitrary ranking
    # directions until its evicted tokens doubled), where alone the prompt is fitted at its first step; the
    # logits parted at the 37th step
    a, b = want.argmax(), torch.stack([got[0].argmax(), got[0].argmax()])
    for step in range(48):
        la, lb = alone.decode(a.reshape(1))[0][0].clone(), batch.decode(b)[0][1].clone()
        assert torch.equal(la, lb), step
        a, b = la.argmax(), torch.stack([la.argmax(), la.argmax()])


@pytest.mark.parametrize(
    "policy, budget, chunk",
    [("full", None, 16), ("snap", 30, 16), ("recall", 40, 16), ("recall", 24, 64), ("h2o", 30, 16)],
)
def test_prompts_of_different_lengths_read_together_give_each_row_what_it_gets_alone(
    embedded, prompt_ids, policy, budget, chunk
):
    """Left padding, bit for bit: three prompts of 30 to 38 tokens read together in chunks of 16 (recall at 40
    holds 30: the 30-token row stays plain h2o while the others are compressed; recall at 24, in one chunk of
    64, fills its store), then decoded, give each row what it keeps alone (every tensor of its slots and store)
    and the logits it gets alone, at the prompt's end and at every step. A chunk's losers went to recall's store
    in `topk`'s order, which changes with their number (a padded row has more). Rows that take PyTorch's fused
    CPU attention (full; snap's and recall's compressed rows) were 0.23-0.71 apart after the prompt: the fused
    kernel sums a padded row's keys in other vector lanes, and a batch mixing rows that want the attention mass
    with rows that do not gave each the other's kind of product (`forward.own_columns`)."""
    import torch

    from h2o_chat.engine.cache import H2OCache
    from h2o_chat.engine.step.decode import Engine
    from h2o_chat.engine.step.prefill import left_pad

    model, pad = embedded.model, embedded.tokenizer.pad_token_id or 0
    long = prompt_ids("Say hello in French, then explain why people greet each other at all.")
    prompts = [prompt_ids("Name three animals."), long[:38], long[:30]]  # (a cut prompt reads as any other)
    assert [len(p) for p in prompts] == [34, 38, 30]

    def engine(rows: int) -> Engine:
        return Engine(model, H2OCache.for_model(model, [make_policy(policy, budget)] * rows), "eager")

    want, kept = [], []
    for p in prompts:
        alone = engine(1)
        logits = [alone.prefill(torch.tensor([p]), chunk_size=chunk)[0].clone()]
        kept.append(alone.cache.row(0).snapshot())
        for _ in range(12):
            logits.append(alone.decode(logits[-1].argmax().reshape(1))[0][0].clone())
        want.append(torch.stack(logits))
    batch = engine(3)
    got = [batch.prefill(*left_pad(prompts, pad), chunk_size=chunk).clone()]
    # what each row keeps is its own too, every tensor of its slots (snap's scores summed a padded row's
    # observation logits in other lanes: last bits apart, which a later eviction could follow) and of its store
    for row, alone in enumerate(kept):
        mine = batch.cache.row(row).snapshot()
        for part in ("slots", "store"):
            if alone[part] is not None:
                for name, t in alone[part].tensors().items():
                    assert torch.equal(getattr(mine[part], name), t), (row, part, name)
    for s in range(12):
        got.append(batch.decode(torch.stack([w[s].argmax() for w in want]))[0].clone())
    got = torch.stack(got, dim=1)  # (rows, steps, V)
    for row, w in enumerate(want):
        assert torch.equal(got[row], w), (row, (got[row] - w).abs().amax(-1))


@pytest.mark.parametrize("policy", ["h2o", "recall"])
def test_rows_in_a_batch_equal_the_same_prompts_alone(embedded, tmp_path, policy):
    """Continuous batching: five prompts through two rows, so three are read into rows that others left; every
    row's greedy text equals its prompt alone (recall: what each prompt evicted goes to its row of the store, and
    a row recalls only its own)."""
    prompts = [
        "Name three animals.",
        "What is 2+2? Answer briefly please.",
        "Write one sentence about rain.",
        "List two colours.",
        "Say hello in French, then explain why people greet each other at all.",
    ]
    lines = [{"id": i, "prompt": p, "max_new_tokens": 8 + 6 * i} for i, p in enumerate(prompts)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    summary = Summary()
    items, _ = read_items(
        inp, embedded.tokenizer, Defaults(max_new_tokens=24, budget=40), summary, lambda b: make_policy(policy, b)
    )
    records = list(generate_batch(embedded, items, make_policy(policy, 40), rows=2))
    together = {r["id"]: r["text"] for r in records}
    assert len(records) == 5 and {r["batch_rows"] for r in records} == {2}
    for item in items:
        alone = next(generate_batch(embedded, [item], make_policy(policy, 40)))
        assert alone["text"] == together[item.id], item.id
        assert alone["batch_rows"] == 1


@pytest.mark.parametrize("policy", ["snap", "h2o"])
def test_a_greedy_two_row_batch_gives_each_row_its_text_alone_under_the_default_weights(embedded, tmp_path, policy):
    """Issue 47.4: with 4-bit weights, a prompt batched with a longer one (left-padded: its prompt chunk has more
    columns than alone) gave another greedy text than alone; every int4 product now gives a row what it gives
    it alone, in decode steps and in prompt chunks."""
    prompts = ["Say hello in five words.", "Write a short poem about the sea."]
    lines = [{"id": i, "prompt": p, "max_new_tokens": 32} for i, p in enumerate(prompts)]
    items, _ = read_items(
        write_lines(tmp_path / "in.jsonl", lines), embedded.tokenizer, Defaults(), Summary(), lambda b: None
    )
    together = {r["id"]: r["text"] for r in generate_batch(embedded, items, make_policy(policy, 512), rows=2)}
    for item in items:
        alone = next(generate_batch(embedded, [item], make_policy(policy, 512)))
        assert alone["text"] == together[item.id], item.id


def test_torn_last_line_is_set_aside_and_redone(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x", "finish_reason": "stop"}\n{"id": "b", "te')
    notes = []
    assert finished_ids(out, notes.append) == {"a"}
    assert out.read_text() == '{"id": "a", "text": "x", "finish_reason": "stop"}\n'
    assert (tmp_path / "out.jsonl.partial").read_text() == '{"id": "b", "te'  # nothing is dropped
    assert notes == ["out.jsonl ended in a partial line (15 bytes, a killed run's): moved to out.jsonl.partial; "
                     "its row runs again"]  # fmt: skip


def test_kill_and_resume_loses_and_repeats_nothing(tmp_path):
    ids = [f"q{i}" for i in range(8)]
    inp = write_lines(
        tmp_path / "in.jsonl", [{"id": i, "prompt": f"Tell me a fact about the number {n}."} for n, i in enumerate(ids)]
    )
    out = tmp_path / "out.jsonl"
    script = Path(sys.executable).with_name("h2o-chat")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "h2o_chat"]
    cmd += ["batch", str(inp), "-o", str(out), "--max-new-tokens", "16", "-b", "32"]
    proc = subprocess.Popen(
        [*cmd, "--batch-size", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 180
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 2):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = out.read_text().count("\n")
    assert 2 <= first < len(ids), "the run should have been killed part-way"

    done = subprocess.run([*cmd, "--batch-size", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = [r["id"] for r in records(out)]
    assert sorted(got) == sorted(ids) and len(got) == len(set(got))
    assert f"{len(ids) - first} done, {first} already in out.jsonl" in done.stderr


def test_a_line_sets_its_own_repetition_penalty(embedded):
    from h2o_chat.app.batch.run import parse_line

    defaults = Defaults(repetition_penalty=1.1)
    line = parse_line(json.dumps({"id": 1, "prompt": "hi", "repetition_penalty": 1.3}), 1, embedded.tokenizer, defaults)
    assert line.repetition_penalty == 1.3
    assert parse_line('{"id": 2, "prompt": "hi"}', 2, embedded.tokenizer, defaults).repetition_penalty == 1.1
    for bad in (0, -1, "x", True):
        text = json.dumps({"id": 3, "prompt": "hi", "repetition_penalty": bad})
        with pytest.raises(ValueError, match="repetition_penalty"):
            parse_line(text, 3, embedded.tokenizer, defaults)


def test_a_line_whose_budget_cannot_fit_in_memory_is_skipped_before_generation(fast_load, tmp_path, monkeypatch):
    """Issue 22.6: such a line is checked against memory like --budget and skipped like a malformed one, so the
    batch completes (it used to kill the run after the other rows, on every rerun). (A budget within the trained
    context, 8,192, on a machine with 64 MB left once the model is loaded: a larger one is capped to the context.)"""
    from h2o_chat.models import memory

    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "ok", "prompt": "Say hi.", "max_new_tokens": 4},
            {"id": "huge", "prompt": "Say hi.", "budget": 8000},
            {"id": "huge2", "prompt": "Say hello.", "budget": 8000},
        ],
    )
    monkeypatch.setattr(memory, "available_memory", lambda: 64 * 2**20)
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out), "-b", "32", "--batch-size", "2"])
    assert result.exit_code == 4, result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("h2o-chat: skipped")]
    assert [line.split(" line ")[1].split(":")[0] for line in skipped] == ["2", "3"]
    assert '"budget" 8000: a 8000-token KV cache for each of 2 rows needs' in skipped[0]
    assert re.search(r'"budget" \d+ fits', skipped[0])
    assert [r["id"] for r in records(out)] == ["ok"]
    last = result.stderr.splitlines()[-1]
    assert "1 done, 0 already in out.jsonl, 2 lines skipped (listed above; exit status 4)" in last


def test_an_empty_input_runs_nothing_and_says_so(fast_load, tmp_path):
    """Issue 22.16: README: exit 2 when no line could be run."""
    (tmp_path / "empty.jsonl").write_text("\n\n")
    result = runner.invoke(cli.app, ["batch", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "empty.jsonl has no lines to run" in result.stderr


def test_one_bad_byte_skips_its_line_only(fast_load, tmp_path):
    """Issue 22.16: a non-UTF-8 byte in one line no longer rejects the whole file."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"id": 1, "prompt": "Say hi.", "max_new_tokens": 2}\n{"id": 2, "prompt": "caf\xe9"}\n')
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 4, result.stderr
    assert "h2o-chat: skipped in.jsonl line 2: not UTF-8 text (byte 25 of the line)" in result.stderr
    assert [r["id"] for r in records(out)] == [1]


def test_a_folder_and_a_hard_link_are_named_for_what_they_are(fast_load, tmp_path):
    """Issue 22.16: `batch /tmp` is a folder, not "not found"; -o a hard link of the input is the input."""
    result = runner.invoke(cli.app, ["batch", str(tmp_path), "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and f"input file {tmp_path} is a folder" in result.stderr
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    os.link(inp, tmp_path / "hard.jsonl")
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(tmp_path / "hard.jsonl")])
    assert result.exit_code == 2 and "is the input file" in result.stderr
    assert inp.read_text() == '{"id": 1, "prompt": "hi"}\n'


def test_a_line_sets_its_own_top_k_and_min_p(embedded):
    """Issue 22.20: top-k and min-p per line, like temperature, checked as the Sampler checks them."""
    from h2o_chat.app.batch.run import parse_line

    defaults = Defaults(top_k=40, min_p=0.05, max_new_tokens=6)
    line = parse_line(json.dumps({"id": 1, "prompt": "hi", "top_k": 5, "min_p": 0.1}), 1, embedded.tokenizer, defaults)
    assert (line.top_k, line.min_p) == (5, 0.1)
    assert parse_line('{"id": 2, "prompt": "hi"}', 2, embedded.tokenizer, defaults).top_k == 40
    for key, bad, message in (
        ("top_k", -1, '"top_k" must be a whole number >= 0'),
        ("top_k", 2.5, '"top_k" must be a whole number'),
        ("min_p", 1.0, '"min_p" must be at least 0'),
        ("temperature", 1e9, '"temperature" must be between 0'),
        ("min_p", "x", '"min_p" must be a number, got "x"'),
    ):
        with pytest.raises(ValueError, match=message):
            parse_line(json.dumps({"id": 3, "prompt": "hi", key: bad}), 3, embedded.tokenizer, defaults)
    items = [
        line,
        parse_line('{"id": 4, "prompt": "hi", "temperature": 1.0, "top_k": 1}', 4, embedded.tokenizer, defaults),
    ]
    greedy = [parse_line('{"id": 5, "prompt": "hi", "temperature": 0}', 5, embedded.tokenizer, defaults)]
    one = next(r for r in generate_batch(embedded, items, make_policy("h2o", 64)) if r["id"] == 4)
    assert one["text"] == next(generate_batch(embedded, greedy, make_policy("h2o", 64)))["text"]  # top-k 1: greedy


def test_an_output_that_is_not_a_regular_file_is_refused_before_loading(fast_load, tmp_path):
    """Issue 38.1: `-o /dev/full` read the device to its (absent) end to find finished ids, and grew to 14 GB;
    /dev/null took the results and lost them. -o is refused as /load refuses such a file, before weights load."""
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi", "max_new_tokens": 2}])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for device in ("/dev/null", "/dev/full", str(fifo)):
        result = runner.invoke(cli.app, ["batch", str(inp), "-o", device])
        assert result.exit_code == 2, (device, result.stderr)
        why = f"-o {device} is not a regular file (a device, a pipe or a socket): give a file name, or -o - for stdout"
        assert result.stderr == f"h2o-chat: error: {why}\n"
    assert fast_load == []  # refused before any model loads


def test_an_output_that_is_not_batchs_own_is_refused_untouched(fast_load, tmp_path):
    """Issue 38.2: a text file lost its last line (no newline), a binary file all of it, and non-JSON lines were
    appended to without a word. Now only batch's own JSONL is appended to; anything else is refused as it is."""
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Say hi.", "max_new_tokens": 2}])
    ours = json.dumps({"id": "z", "text": "earlier", "finish_reason": "stop"})
    for name, content in (
        ("notes.txt", b"first line\nlast line without a newline"),
        ("image.bin", bytes(range(256)) * 4),
        ("mixed.jsonl", f"{ours}\nnot json\n".encode()),
        ("input-like.jsonl", b'{"id": "a", "prompt": "Say hi."}'),  # whole JSON, not a result: not a torn line
    ):
        out = tmp_path / name
        out.write_bytes(content)
        result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
        assert result.exit_code == 2, (name, result.stderr)
        assert result.stderr.startswith(f"h2o-chat: error: -o {out} is not batch's output (line ")
        assert result.stderr.count("\n") == 1 and out.read_bytes() == content, name
    assert fast_load == [] and not list(tmp_path.glob("*.partial*"))  # refused before loading, nothing moved


def test_a_killed_runs_last_line_is_completed_or_set_aside_with_a_word(fast_load, tmp_path):
    """Issue 38.2: a last line without its newline is a killed run's: a whole record gets its newline (its row is
    done), a record cut short is moved to <file>.partial and its row runs again; one line on stderr says which."""
    lines = [{"id": i, "prompt": "Say hi.", "max_new_tokens": 2} for i in ("a", "b")]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    whole = json.dumps({"id": "a", "text": "hi", "finish_reason": "length"})
    out = tmp_path / "whole.jsonl"
    out.write_text(whole)
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert "h2o-chat: whole.jsonl: its last line lacked its newline (a killed run's); added it" in result.stderr
    assert out.read_text().startswith(whole + "\n") and [r["id"] for r in records(out)] == ["a", "b"]
    torn = whole + "\n" + json.dumps({"id": "b", "text": "hel"})[:20]
    out = tmp_path / "torn.jsonl"
    out.write_text(torn)
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert "torn.jsonl ended in a partial line (20 bytes, a killed run's): moved to torn.jsonl.partial" in (
        result.stderr
    )
    assert (tmp_path / "torn.jsonl.partial").read_text() == torn.split("\n")[1]
    assert [r["id"] for r in records(out)] == ["a", "b"] and "1 done, 1 already in torn.jsonl" in result.stderr


def test_dash_writes_the_results_to_stdout_and_a_terminal_is_refused(fast_load, tmp_path, monkeypatch):
    """Issue 38.3: `-o -` created a file named "-"; `-o /dev/stdout` on a terminal read the keyboard as earlier
    results. `-o -` now writes the results to stdout (progress and summary on stderr, nothing to resume); a
    terminal given by name is refused, pointing to `-o -`."""
    lines = [{"id": i, "prompt": "Say hi.", "max_new_tokens": 2} for i in ("a", "b")]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", "-"])
    assert result.exit_code == 0, result.stderr
    assert sorted(json.loads(line)["id"] for line in result.stdout.splitlines()) == ["a", "b"]
    assert "h2o-chat: a: 2 tokens" in result.stderr and "h2o-chat: batch: 2 done, 0 skipped |" in result.stderr
    assert not (tmp_path / "-").exists()
    leader, follower = os.openpty()
    try:
        terminal = os.ttyname(follower)
        result = runner.invoke(cli.app, ["batch", str(inp), "-o", terminal])
    finally:
        os.close(leader), os.close(follower)
    assert result.exit_code == 2 and result.stderr == (
        f"h2o-chat: error: -o {terminal} is not a regular file (a device, a pipe or a socket): give a file name, "
        "or -o - for stdout\n"
    )


def test_a_line_sets_its_own_seed_and_top_p(fast_load, tmp_path):
    """Issue 38.7: "seed" and "top_p" were unknown keys; a line now sets them as it sets its temperature (lines
    that share them run in one batch). A line with a seed gives the text its prompt gives alone with that seed."""
    line = {"prompt": "Name a fruit.", "temperature": 1.0, "max_new_tokens": 8}
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "s1", **line, "seed": 7},
            {"id": "s2", **line, "seed": 7},
            {"id": "p", **line, "top_p": 0.5, "seed": 3},
            {"id": "bad-p", **line, "top_p": 0},
            {"id": "bad-seed", **line, "seed": "x"},
            {"id": "negative-seed", **line, "seed": -5},
            {"id": "wide-seed", **line, "seed": 2**31},
        ],
    )
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 4, result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("h2o-chat: skipped")]
    assert skipped == [
        'h2o-chat: skipped in.jsonl line 4: "top_p" must be above 0 and at most 1, got 0',
        'h2o-chat: skipped in.jsonl line 5: "seed" must be a whole number, got "x"',
        'h2o-chat: skipped in.jsonl line 6: "seed" must be a whole number from 0 to 2147483647, got -5',
        'h2o-chat: skipped in.jsonl line 7: "seed" must be a whole number from 0 to 2147483647, got 2147483648',
    ]
    got = {r["id"]: r["text"] for r in records(out)}
    assert set(got) == {"s1", "s2", "p"} and got["s1"] == got["s2"]
    alone = tmp_path / "alone.jsonl"
    write_lines(alone, [{"id": "s1", **line, "seed": 7}])
    assert runner.invoke(cli.app, ["batch", str(alone), "-o", str(tmp_path / "a.jsonl")]).exit_code == 0
    assert records(tmp_path / "a.jsonl")[0]["text"] == got["s1"]


def test_lines_with_their_own_seeds_and_top_p_share_a_batch_each_drawing_as_alone(fast_load, tmp_path):
    """A batch of lines that each carry a seed (or a top-p of their own) ran one line at a time: lines were grouped
    by their top-p and seed values. Lines now group by what their sampling asks of a step (top-p cutting or not,
    any filter or none; a greedy line's filters do nothing), each row with its own values, and each line gives
    the text it gives alone."""
    line = {"prompt": "Name a fruit.", "temperature": 1.0, "max_new_tokens": 8}
    lines = [{"id": f"p{i}", **line, "seed": i, "top_p": p} for i, p in enumerate((0.8, 0.9, 0.95, 0.7))]
    lines += [
        {"id": "whole", **line, "seed": 9},  # top-p 1: the whole vocabulary
        {"id": "greedy", **line, "temperature": 0, "top_p": 0.5, "top_k": 3},  # its filters change nothing
    ]
    out = tmp_path / "out.jsonl"
    result = runner.invoke(cli.app, ["batch", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    got = {r["id"]: r for r in records(out)}
    assert {i: r["batch_rows"] for i, r in got.items()} == {"p0": 4, "p1": 4, "p2": 4, "p3": 4, "whole": 2, "greedy": 2}
    for one in lines:
        alone = tmp_path / f"alone-{one['id']}.jsonl"
        path = write_lines(tmp_path / f"in-{one['id']}.jsonl", [one])
        assert runner.invoke(cli.app, ["batch", str(path), "-o", str(alone)]).exit_code == 0
        assert records(alone)[0]["text"] == got[one["id"]]["text"], one["id"]
    assert len({got[f"p{i}"]["text"] for i in range(4)}) > 1  # their own seeds: not one draw four times


def test_ctrl_c_says_how_many_rows_are_done_and_how_to_resume(fast_load, tmp_path, monkeypatch):
    """Issue 38.7: Ctrl-C printed only "interrupted"; it now says how many rows are done and that a rerun with
    the same -o resumes (and the rerun does)."""
    from h2o_chat.app.batch import run as batch

    real = batch.generate_batch

    def interrupted(*args, **kwargs):
        yield next(real(*args, **kwargs))
        raise KeyboardInterrupt  # Ctrl-C once the first row is written

    inp = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": "Say hi.", "max_new_tokens": 2} for i in range(3)])
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(batch, "generate_batch", interrupted)
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 130
    assert result.stderr.splitlines()[-1] == (
        f"h2o-chat: batch interrupted: 1 row done and added to {out}; a rerun with the same -o resumes"
    )
    monkeypatch.setattr(batch, "generate_batch", real)
    result = runner.invoke(cli.app, ["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 0 and "2 done, 1 already in out.jsonl" in result.stderr
    assert sorted(r["id"] for r in records(out)) == [0, 1, 2]
