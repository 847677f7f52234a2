"""The real command as a new user meets it (issue 38): bench's summary, --download offline, --help text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from typer.testing import CliRunner

from h2o_chat.app import cli

runner = CliRunner()


def invoke(args, stdin: bytes | str = b""):
    return runner.invoke(cli.app, args, input=stdin)


def test_bench_ratio_divides_by_a_figure_its_table_shows(fast_load):
    """Issue 38.10: 'at 80 seen / at 40 seen' divided by the h2o twin timed beside 80, which the table hid
    (its 40 row is another measurement): the twin is a labelled row and the ratio names it."""
    result = invoke(["bench", "--lengths", "40,80", "--budget", "32", "--steps", "2", "--configs", "full,h2o"])
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 3 and re.fullmatch(r"\d+( \(twin\))?", cells[0]):
            rows[cells[0]] = float(cells[2].split(" | ")[0])  # the h2o column's ms/token
    assert set(rows) == {"40", "80", "40 (twin)"}, out
    line = next(line for line in out.splitlines() if "at 80 seen / at 40 seen" in line)
    assert "twin" in line, line
    value = float(re.search(r"([\d.]+)x", line).group(1))
    assert abs(value - rows["80"] / rows["40 (twin)"]) < 0.02, (line, rows)


def test_download_without_network_fails_fast_on_one_line(tmp_path):
    """Issue 38.9: --download without network printed the Hub client's retry lines for ~27 s before ours."""
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_ENDPOINT="https://h2o-chat-test.invalid", NO_COLOR="1")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "h2o_chat", "-m", "qwen2-7b", "--download", "--device", "cpu"],
        input="hi",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    seconds = time.monotonic() - start
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and done.stdout == "", done
    assert len(lines) == 1 and lines[0].startswith("h2o-chat: error: could not download Qwen/Qwen2-7B-Instruct"), lines
    assert "h2o-chat-test.invalid" in lines[0] and seconds < 15, (seconds, lines)


def test_eval_help_wraps_each_command_at_the_width_not_mid_sentence():
    """Issue 38.12: `eval --help` broke the recall entry at its docstring's line ends ('greedy hits' alone)."""
    for width in (80, 120):  # a process each: the help's width is read once per process
        env = dict(os.environ, COLUMNS=str(width), TERMINAL_WIDTH=str(width))
        env.pop("NO_COLOR", None)
        out = subprocess.run(
            [sys.executable, "-m", "h2o_chat", "eval", "--help"], capture_output=True, text=True, env=env, timeout=60
        ).stdout
        rows = [line[2:].rstrip("│ ") for line in out.splitlines() if line.startswith("│")]
        start = next(i for i, row in enumerate(rows) if row.startswith("recall "))
        entry = rows[start : start + 1]
        for row in rows[start + 1 :]:  # its continuation lines (indented under the text)
            if not row.startswith(" " * 4):
                break
            entry.append(row)
        for line, after in zip(entry, entry[1:], strict=False):
            # a line ends early only where the next word would not have fitted on it
            assert len(line) + 1 + len(after.split()[0]) > width - 6, (width, entry)


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("h2o-chat: error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_prompt_file_is_the_piped_prompt_and_a_bad_one_is_one_line(fast_load, tmp_path):
    """-f FILE, as llama-cli's: piped mode generates for the file's text as it does for the same text on stdin."""
    path = tmp_path / "prompt.txt"
    path.write_text("Name three colours.", encoding="utf-8")
    args = ["--max-new-tokens", "3", "--temperature", "0", "--json"]
    from_file = invoke(["-f", str(path), *args])
    assert from_file.exit_code == 0, from_file.stderr
    from_stdin = invoke(args, stdin="Name three colours.")
    assert json.loads(from_file.stdout)["text"] == json.loads(from_stdin.stdout)["text"]
    assert json.loads(from_file.stdout)["prompt_tokens"] == json.loads(from_stdin.stdout)["prompt_tokens"]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    assert_one_line_error(invoke(["-f", str(tmp_path / "missing.txt")]), "missing.txt")
    assert_one_line_error(invoke(["-f", str(tmp_path / "latin1.txt")]), "not UTF-8")
    assert_one_line_error(invoke(["-f", str(tmp_path / "empty.txt")]), "empty")
    assert_one_line_error(invoke(["-f", str(tmp_path)]), str(tmp_path))  # a folder


def test_a_chat_template_file_replaces_the_tokenizers_and_a_bad_one_is_one_line(fast_load, embedded, tmp_path):
    """--chat-template FILE: a Jinja template used instead of the tokenizer's; one that cannot work is one line."""
    before = embedded.tokenizer.chat_template
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}",
        encoding="utf-8",
    )
    args = ["--max-new-tokens", "2", "--temperature", "0", "--json"]
    ours = invoke(["--chat-template", str(template), *args], stdin="Hi")
    assert ours.exit_code == 0, ours.stderr
    theirs = invoke(args, stdin="Hi")
    assert json.loads(ours.stdout)["prompt_tokens"] != json.loads(theirs.stdout)["prompt_tokens"]
    assert embedded.tokenizer.chat_template == before  # the loaded tokenizer is left as it was
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    (tmp_path / "fails.jinja").write_text("{{ messages[0].content.nope.deeper }}", encoding="utf-8")
    (tmp_path / "blind.jinja").write_text("Hello", encoding="utf-8")
    assert_one_line_error(invoke(["--chat-template", str(tmp_path / "broken.jinja")], stdin="Hi"), "not a Jinja")
    assert_one_line_error(invoke(["--chat-template", str(tmp_path / "fails.jinja")], stdin="Hi"), "cannot render")
    assert_one_line_error(invoke(["--chat-template", str(tmp_path / "blind.jinja")], stdin="Hi"), "messages")
    assert_one_line_error(invoke(["--chat-template", str(tmp_path / "none.jinja")], stdin="Hi"), "none.jinja")


# -- issue 48: habits from ollama and llama-cli, -f from a pipe -------------------------------------------------
def test_ollama_and_llama_cli_habits_do_what_they_do_there(fast_load, tiny_folder):
    """Issue 48.8: `h2o-chat run llama-2-7b` replied to the prompt "run llama-2-7b", `list` generated text, and -n,
    -t, -s were unknown. `run MODEL` names the model (as ollama's), `list` is `models`, -n/-t/-s are
    --max-new-tokens/--threads/--seed; a flag that means something else here says what it is."""
    import torch

    assert_one_line_error(invoke(["run", "llama-2-7b"], "hi"), "llama-2-7b", "not on this machine")
    reply = invoke(["run", str(tiny_folder), "--raw", "--json", "-n", "3", "--temperature", "0", "w5", "w6"])
    assert reply.exit_code == 0, reply.stderr
    record = json.loads(reply.stdout)
    assert record["prompt_tokens"] == 2 and record["generated_tokens"] <= 3  # the words after MODEL, alone
    assert fast_load == ["llama-2-7b", str(tiny_folder)]
    assert_one_line_error(invoke(["run"], "hi"), "run needs a model")
    assert_one_line_error(invoke(["run", "x", "-m", "y"], "hi"), "run x and --model y both name the model")
    models = invoke(["list"])
    assert models.exit_code == 0 and models.stdout.startswith("alias") and models.stdout == invoke(["models"]).stdout
    before = torch.get_num_threads()
    try:
        args = ["-n", "4", "-s", "11", "-t", "1", "--json", "--temperature", "1.5", "Name a colour."]
        runs = [json.loads(invoke(args).stdout) for _ in range(2)]
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert runs[0]["text"] == runs[1]["text"] and runs[0]["generated_tokens"] <= 4
    assert_one_line_error(invoke(["-s", "-2"], "hi"), "--seed must be a whole number >= 0, or -1 for a random one")
    # what means something else here: said, instead of a nearest spelling (--ctx-size suggested --chunk-size)
    result = invoke(["--ctx-size", "4096", "hi"])
    assert result.exit_code == 2 and "--budget" in result.stderr and "--chunk-size" not in result.stderr
    assert result.stderr.startswith("h2o-chat: error: No such option: --ctx-size: llama.cpp's context size")
    # an option of another of h2o-chat's commands says which takes it (click suggested --version for --session-dir)
    for args, option, owner in (  # the program's name is the runner's here ('h2o-chat' when installed)
        (["--session-dir", "d", "hi"], "--session-dir", " serve'"),
        (["batch", "x.jsonl", "-o", "y", "--session-dir", "d"], "--session-dir", " serve'"),
        (["serve", "--resume", "x"], "--resume", "' (the chat and one-shot replies)"),
        (["bench", "--haystack", "x"], "--haystack", " eval needle'"),
    ):
        result = invoke(args)
        assert result.exit_code == 2 and "--version" not in result.stderr, result.stderr
        assert re.search(f"No such option: {option}: an option of '[\\w-]+{re.escape(owner)}", result.stderr), (
            result.stderr
        )
    assert_one_line_error(
        invoke(["-p", "What is 2+2?"]), "-p is --policy here", "give the prompt as an argument: h2o-chat 'What is 2+2?'"
    )
    assert_one_line_error(invoke(["chat"], "hi"), "chat needs a terminal on stdin")
    assert_one_line_error(invoke(["-n", "0"], "hi"), "--max-new-tokens 0 only reads a prompt into --prompt-cache")
    # plain text has no system turn: --system with --raw was dropped without a word (the prompt read alone)
    assert_one_line_error(
        invoke(["--raw", "--system", "You are a pirate.", "-n", "4"], "1, 2, 3,"),
        "--system needs the chat template, which --raw leaves out",
    )


def test_an_option_the_policy_ignores_is_refused_before_the_weights_load(fast_load, tmp_path):
    """`-p h2o --recall-memory 64MB` ran without a store and `-p full --budget 256` with every token, without a
    word: what a policy does not read is one line, for the chat, batch and serve alike."""
    for args, line in (
        (["-p", "h2o", "--recall-memory", "64MB"], "--recall-memory does nothing under -p h2o, which does not use it"),
        (["-p", "full", "-b", "256"], "--budget does nothing under -p full, which holds every token"),
        (["-p", "full", "--kv-memory", "64MB"], "--kv-memory does nothing under -p full"),
        (["-p", "full", "--positions", "rolling"], "--positions does nothing under -p full, which holds every token"),
        (["-p", "recent", "--sinks", "2", "--heavy-ratio", "0.3"], "--heavy-ratio and --sinks do nothing"),
        (["-p", "snap", "--recall-memory", "4x"], "leave it out, or choose -p recall"),
        (["-p", "h2o", "--snap-window", "4"], "choose -p snap | recall"),
    ):
        assert_one_line_error(invoke([*args, "-n", "2", "hi"]), line)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hi"}\n')
    for command in (["batch", str(inp), "-o", str(tmp_path / "out.jsonl")], ["serve", "--port", "0"]):
        assert_one_line_error(invoke([*command, "-p", "h2o", "--snap-kernel", "3"]), "--snap-kernel does nothing")
    assert fast_load == [] and not (tmp_path / "out.jsonl").exists()  # refused before anything loaded
    # what the policy reads runs, its default given or not
    for args in (["-p", "sink", "--sinks", "2"], ["-p", "full"], ["-p", "h2o", "--heavy-ratio", "0.5", "-b", "64"]):
        result = invoke([*args, "--json", "-n", "2", "--temperature", "0", "hi"])
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["generated_tokens"] == 2


def test_ignore_eos_writes_on_to_max_new_tokens(fast_load, tmp_path):
    """Issue 48.8: --ignore-eos (llama-cli's): a piped reply and a batch's rows run to --max-new-tokens past the
    end-of-sequence token, for a generation of known length."""
    args = ["--json", "-n", "48", "--temperature", "0", "Say hi."]
    ended = json.loads(invoke(args).stdout)
    assert ended["finish_reason"] == "stop" and ended["generated_tokens"] < 48  # the reply ends by itself (29)
    on = json.loads(invoke([*args, "--ignore-eos"]).stdout)
    assert (on["finish_reason"], on["generated_tokens"]) == ("length", 48) and on["text"].startswith(ended["text"])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "Say hi.", "max_new_tokens": 48}\n')
    result = invoke(["batch", str(inp), "-o", str(out), "--ignore-eos"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(out.read_text())["generated_tokens"] == 48


def test_a_prompt_file_may_be_a_pipe_or_stdin(fast_load, embedded, tmp_path):
    """Issue 48.9: `-f <(echo ...)` and `-f /dev/stdin` were "not a regular file", `-f -` "not found". A prompt
    file is any readable stream; `-` is standard input."""
    from test_chat import _installed_command

    text = "Name three colours."
    expected = len(embedded.tokenizer(text)["input_ids"])
    args = ["--raw", "--json", "-n", "1", "--temperature", "0"]
    dash = invoke(["-f", "-", *args], stdin=text)
    assert dash.exit_code == 0, dash.stderr
    assert json.loads(dash.stdout)["prompt_tokens"] == expected
    assert_one_line_error(invoke(["-f", "-", *args], stdin=""), "the prompt file standard input (-f -) is empty")
    command = " ".join(f"'{word}'" for word in [*_installed_command(), *args])
    for how, stdin in ((f"{command} -f <(printf '{text}')", None), (f"{command} -f /dev/stdin", text)):
        done = subprocess.run(["bash", "-c", how], input=stdin, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (how, done.stderr)
        assert json.loads(done.stdout)["prompt_tokens"] == expected, how


def test_a_budget_beyond_the_trained_context_is_capped_and_said(fast_load, tmp_path):
    """Issue 48.10: `-b 100000` on an 8,192-token model was taken silently (4.5 GB allocated, 1.1 tok/s). A budget
    past the trained context can only hold tokens at positions the model never learned: the budget is the context,
    and stderr says why (--budget, --kv-memory and a batch line's "budget" alike)."""
    result = invoke(["-b", "100000", "--json", "-n", "1", "--temperature", "0"], "Hi")
    assert result.exit_code == 0, result.stderr
    cache = json.loads(result.stdout)["cache"]
    assert cache["budget"] == 8192 and cache["kv_bytes"] < 8193 * 30 * 3 * 532 + 64  # the context's slots, no more
    said = "h2o-chat: --budget 100000: the budget is 8,192 tokens, the model's trained context: a larger cache would"
    assert result.stderr.startswith(said), result.stderr
    result = invoke(["--kv-memory", "10GB", "--json", "-n", "1", "--temperature", "0"], "Hi")
    assert (
        json.loads(result.stdout)["cache"]["budget"] == 8192
        and "--kv-memory 10GB: the budget is 8,192" in result.stderr
    )
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "Hi", "budget": 100000, "max_new_tokens": 1}\n')
    result = invoke(["batch", str(inp), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert 'lines with "budget" 100000 run with a budget of 8,192 tokens, the model\'s trained' in result.stderr
    assert json.loads(out.read_text())["cache"]["budget"] == 8192


def test_a_one_token_reply_times_no_decode_step(fast_load):
    """Issue 48.13: a 1-token reply reported 0.0 tok/s: its one token comes from the prompt's reading, so no decode
    step was timed; the summary, --json and the panel say so instead of a speed."""
    from h2o_chat.app.ui import TurnStats

    result = invoke(["-n", "1", "--temperature", "0"], "Say hi.")
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("h2o-chat: 1 token, no decode step to time (prompt ") and "0.0 tok/s" not in summary
    assert json.loads(invoke(["-n", "1", "--json"], "Say hi.").stdout)["decode_tps"] is None
    assert TurnStats(prompt_tps=900.0, generation_tps=None).speed() == "prefill 900 tok/s, no decode step to time"
    assert TurnStats(prompt_tps=900.0, generation_tps=None).speed(compact=True) == "prefill 900 tok/s"


def test_decode_that_collapses_on_a_busy_cpu_says_threads_1_may_help(fast_load, monkeypatch):
    """Issue 48.14: another process took a core and tok/s fell 40x with no hint. A piped run says it when it
    happens and in its summary (the chat's note: test_chat); here the clock and the load are the test's."""
    from h2o_chat.app.chat import slowdown

    now, calls = [0.0], [0]

    def clock():  # steps of 20 ms, then of 800 ms: the pace of a 2-core machine when a core is taken
        calls[0] += 1
        now[0] += 0.02 if calls[0] <= 1 + 3 * slowdown.WINDOW else 0.8
        return now[0]

    monkeypatch.setattr(slowdown, "clock", clock)
    monkeypatch.setattr(slowdown, "load_average", lambda: 5.0)
    monkeypatch.setattr(slowdown, "torch_threads", lambda: 2)
    monkeypatch.setattr(slowdown, "WINDOW", 4)
    result = invoke(["-n", "24", "--ignore-eos", "--temperature", "0"], "Count to five.")
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "decode slowed to" in line]
    assert len(notes) == 1 and notes[0].startswith("h2o-chat: note: decode slowed to 1.2 tok/s from 50.0 earlier")
    assert notes[0].endswith("--threads 1 may help")
    assert result.stderr.splitlines()[-1].endswith(" | decode slowed 40x on a busy CPU: try --threads 1")
