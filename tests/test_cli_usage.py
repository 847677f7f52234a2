"""The real command as a new user meets it (issue 38): bench's summary, --download offline, --help text."""

from __future__ import annotations

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
