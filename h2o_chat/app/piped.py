"""Piped and one-shot mode: the whole of stdin (or the prompt argument, followed by any piped text) is one
prompt; only generated text goes to stdout, streamed; a progress bar (on a terminal), notes and a one-line
summary go to stderr. Ctrl-C ends the run with what was generated so far (--json: a record saying so)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from h2o_chat.app.chat.conversation import ChatSettings, Conversation
from h2o_chat.app.chat.resume import load_conversation
from h2o_chat.app.prompt_cache import PromptCache, PromptCacheOptions, read_only_line
from h2o_chat.app.ui import (
    ProgressBar,
    describe_weights,
    duration,
    make_console,
    reading_label,
    summary_line,
    wrap,
)
from h2o_chat.engine.policies import Policy
from h2o_chat.errors import InputError
from h2o_chat.models.loading import Loaded


@dataclass(frozen=True)
class RunOptions:
    policy: Policy
    settings: ChatSettings
    panel: bool = True
    json: bool = False
    raw: bool = False  # piped: feed stdin as plain text, no chat template
    resume: Path | None = None  # --resume FILE: a saved conversation (and its cache) to continue
    prompt_cache: PromptCacheOptions | None = None  # --prompt-cache FILE (piped)


def read_stdin_prompt(data: bytes, required: bool = True) -> str | None:
    """Decode piped input strictly: one clear error for non-UTF-8 input, and for empty input when it is the
    whole prompt (`required`); None for empty input beside a prompt argument."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it first, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        if not required:
            return None
        raise InputError("stdin is empty: pipe a prompt, e.g. echo 'Tell me a story' | h2o-chat")
    return text


def combine_prompt(argument: str | None, piped: str | None) -> str:
    """`cat notes.txt | h2o-chat "Summarise:"`: the argument first, then the piped text (as ollama does)."""
    if argument is None or piped is None:
        return argument if piped is None else piped
    return f"{argument}\n\n{piped}"


SLOW_READING = 60.0  # seconds: a prompt that will take longer to read gets a note when its reading starts


class ReadingForecast:
    """Times the second prefill chunk of a prompt (the first pays one-time costs: measured 3-7x slower); when the
    rest will take over `threshold` seconds at that speed, gives one note (tokens, projected time, what reads
    faster) before most of it is read."""

    def __init__(self, threshold: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.threshold = SLOW_READING if threshold is None else threshold
        self.clock = clock
        self.started: float | None = None
        self.first: tuple[float, int] | None = None  # when the first chunk ended, and what it had read
        self.done = False

    def __call__(self, done: int, total: int, tokens: int) -> str | None:
        """`done` and `total` count every pass over the prompt (snap reads it twice), `tokens` the prompt's."""
        now = self.clock()
        if done == 0:
            self.started, self.first, self.done = now, None, False
            return None
        if self.done or self.started is None or done >= total:
            return None
        if self.first is None:
            self.first = (now, done)
            return None
        self.done = True
        rate = (done - self.first[1]) / max(1e-9, now - self.first[0])
        whole = now - self.started + (total - done) / rate
        if whole < self.threshold:
            return None
        twice = " (twice: snap's probe reads the prompt first)" if total > tokens else ""
        return (
            f"reading {tokens:,} tokens{twice} will take about {duration(whole)} at {rate:,.0f} tok/s; "
            "a larger --chunk-size, or a GPU, reads faster"
        )


class Stdout:
    """The reply's text on stdout, remembering whether its last line is open: a note said meanwhile on the
    same terminal starts on a line of its own instead of being glued to the reply."""

    def __init__(self, out):
        self.out, self.open = out, False

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.open = not text.endswith("\n")

    def break_line(self) -> str:
        """What a line for stderr starts with: a line break when the reply's open line is on the terminal (the
        reply then goes on below that line)."""
        if self.open and _isatty(self.out):
            self.open = False
            return "\n"
        return ""


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def run_piped(loaded: Loaded, options: RunOptions, prompt: str) -> dict:
    """Generate for the whole of stdin; text streams to stdout, a summary goes to stderr (or JSON to stdout)."""
    settings = options.settings
    conv = Conversation(loaded, options.policy, settings)
    out = Stdout(sys.stdout)
    err = make_console(stderr=True)
    # stderr: a progress bar while a long prompt is read (only on a terminal), and notes before the reading
    bar = ProgressBar(err, lambda done, total: reading_label(total, conv.pending), 256)
    forecast = ReadingForecast()

    def say(line: str) -> None:  # printed above the bar while one is drawn
        wrap(err, out.break_line() + f"h2o-chat: {line}", markup=False, highlight=False)

    def progress(done: int, total: int) -> None:
        for notice in [*conv.cache.pop_notices(), forecast(done, total, conv.pending)]:
            if notice:
                say(f"note: {notice}")
        bar(done, total)

    conv.on_setup = lambda message: say(f"{message} ...")
    if options.resume is not None:  # the piped prompt is the saved conversation's next message
        load_conversation(conv, options.resume)
    cached, ids = None, None
    if options.prompt_cache is not None:  # step 1 from the file, or read and saved to it (`prompt_cache.py`)
        cached = PromptCache(options.prompt_cache)
        ids = cached.start(conv, prompt, options.raw, progress)
        bar.close()
        if cached.note:
            say(f"note: {cached.note}")
        if options.prompt_cache.read_only:
            return _read_only(loaded, conv, cached, options, say)
    pieces, last = [], None
    try:
        for r in conv.send(prompt, progress=progress, raw=options.raw, ids=ids):
            if last is None:
                bar.close()  # the prompt is read: stderr's bar gives way to the text on stdout
            last = r
            pieces.append(r.text)
            if not options.json:
                out.write(r.text)
            for notice in conv.cache.pop_notices():
                say(f"note: {notice}")
        if last is None:  # Ctrl-C while the prompt's last chunk was read: the turn ends before its first token
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        bar.close()
        if options.json:  # what was generated so far, and why it ends there
            record = _record(loaded, conv, pieces, last, "interrupted")
            _amend(record, cached, last)
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            out.write("\n" if out.open else "")
        sys.stdout.flush()
        raise
    bar.close()
    record = _record(loaded, conv, pieces, last, last.finish_reason)
    _amend(record, cached, last)
    if options.json:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        summary = summary_line(last, conv.stats(), conv.engine.describe(), conv.speeds(last), describe_weights(loaded))
        if conv.pace.watch.summary:
            summary += f" | {conv.pace.watch.summary}"
        say(summary + (f" | {cached.summary()}" if cached is not None else ""))
    sys.stdout.flush()
    return record


def _record(loaded: Loaded, conv: Conversation, pieces: list[str], last, finish_reason: str | None) -> dict:
    """The --json record: the text, why it ended, token counts, speeds (a one-time setup apart), cache stats."""
    prompt_tps, decode_tps, setup = conv.speeds(last) if last is not None else (0.0, None, 0.0)
    return {
        "model": loaded.spec.name,
        "text": "".join(pieces),
        "finish_reason": finish_reason,
        "prompt_tokens": last.prompt_tokens if last is not None else conv.pending,
        "generated_tokens": last.generation_tokens if last is not None else 0,
        "prompt_tps": round(prompt_tps, 2),
        "decode_tps": None if decode_tps is None else round(decode_tps, 2),  # None: no decode step ran
        "setup_seconds": round(setup, 2),
        "decode": conv.engine.describe(),
        "weights": {"format": loaded.weights, "bytes": loaded.weight_bytes},
        "cache": conv.stats().as_dict(),
    }


def _amend(record: dict, cached: PromptCache | None, last) -> None:
    """The record's prompt counts with --prompt-cache (`cached_prompt_tokens`: 0 without it)."""
    if cached is None:
        record["cached_prompt_tokens"] = 0
    else:
        cached.amend(record, last.prompt_tokens if last is not None else 0)


def _read_only(loaded: Loaded, conv: Conversation, cached: PromptCache, options: RunOptions, say) -> dict:
    """--prompt-cache with --max-new-tokens 0: the prompt's text read into the file (or found there), no reply."""
    record = _record(loaded, conv, [], None, None)
    cached.amend(record, 0)
    if cached.read:
        record["prompt_tps"] = round(cached.read / cached.seconds, 2) if cached.seconds else 0.0
    if options.json:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    else:
        say(read_only_line(cached))
    return record
