"""The turn loops: piped (stdin is the prompt) and interactive. They wire a Conversation to the UI."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from h2o_chat.app.conversation import ChatSettings, Conversation, budget_note
from h2o_chat.app.ui import (
    COMPACT_BELOW,
    PanelView,
    ProgressBar,
    StreamView,
    TurnStats,
    describe_device,
    describe_policy,
    eviction_table,
    human_bytes,
    make_console,
    summary_line,
)
from h2o_chat.engine.policies import DEFAULT_POLICY, Policy
from h2o_chat.errors import H2OChatError, InputError
from h2o_chat.files import user_data_dir
from h2o_chat.models.loading import Loaded


@dataclass(frozen=True)
class RunOptions:
    policy: Policy
    settings: ChatSettings
    panel: bool = True
    json: bool = False
    raw: bool = False  # piped: feed stdin as plain text, no chat template


def read_stdin_prompt(data: bytes) -> str:
    """Decode piped input strictly: one clear error for empty or non-UTF-8 input."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it first, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise InputError("stdin is empty: pipe a prompt, e.g. echo 'Tell me a story' | h2o-chat")
    return text


def reading_label(total: int, prompt_tokens: int) -> str:
    """What a prompt-reading bar says: snap reads a prompt that overflows the budget twice (one bar over 2x)."""
    return "reading the prompt" + (" (twice: snap)" if prompt_tokens and total >= 2 * prompt_tokens else "")


def run_piped(loaded: Loaded, options: RunOptions, prompt: str) -> dict:
    """Generate for the whole of stdin; text streams to stdout, a summary goes to stderr (or JSON to stdout)."""
    conv = Conversation(loaded, options.policy, options.settings)
    # stderr: a progress bar while a long prompt is read (only on a terminal), and notes before the reading
    bar = ProgressBar(make_console(stderr=True), lambda done, total: reading_label(total, conv.pending), 256)

    def progress(done: int, total: int) -> None:
        for notice in conv.cache.pop_notices():
            bar.console.print(f"h2o-chat: note: {notice}", markup=False, highlight=False)
        bar(done, total)

    conv.engine.on_setup = lambda message: print(f"h2o-chat: {message} ...", file=sys.stderr)

    if options.raw:
        from h2o_chat.engine.generate import stream_generate

        ids = loaded.tokenizer(prompt)["input_ids"]
        conv.pending = len(ids)
        note = budget_note(len(ids), options.policy.budget)
        if note:
            conv.cache.notices.append(note)
        progress(0, len(ids))
        stream = stream_generate(
            loaded.model,
            loaded.tokenizer,
            conv.cache,
            ids,
            sampler=options.settings.sampler,
            max_new_tokens=options.settings.max_new_tokens,
            chunk_size=options.settings.chunk_size,
            progress=progress,
            engine=conv.engine,
        )
    else:
        stream = conv.send(prompt, progress=progress)
    out = sys.stdout
    pieces, last = [], None
    for r in stream:
        if last is None:
            bar.close()  # the prompt is read: stderr's bar gives way to the text on stdout
        last = r
        pieces.append(r.text)
        if not options.json and r.text:
            out.write(r.text)
            out.flush()
        for notice in conv.cache.pop_notices():
            print(f"h2o-chat: note: {notice}", file=sys.stderr)
    stats = conv.cache.stats()
    record = {
        "model": loaded.spec.name,
        "text": "".join(pieces),
        "finish_reason": last.finish_reason,
        "prompt_tokens": last.prompt_tokens,
        "generated_tokens": last.generation_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "decode_tps": round(last.generation_tps, 2),
        "decode": conv.engine.describe(),
        "cache": stats.as_dict(),
    }
    bar.close()
    if options.json:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
        print(f"h2o-chat: {summary_line(last, stats, conv.engine.describe())}", file=sys.stderr)
    out.flush()
    return record


# -- interactive ----------------------------------------------------------------------------------------
HELP = """\
/help              this list
/budget N          set the cache budget (tokens per layer); a smaller one evicts now
/policy NAME       h2o | snap | sink | recent | full
/system TEXT       set the system prompt (the conversation is re-read on the next turn)
/reset             start over, keeping the system prompt
/save FILE         save the conversation as JSON
/load FILE         load a saved conversation (read on the next turn)
/stats             show the cache and memory panel
/evicted           which messages are no longer fully in the cache
/exit              leave (or Ctrl-D); Ctrl-C stops a reply
Enter sends; Alt-Enter (or Esc then Enter) adds a line; pasted text keeps its lines."""


@contextlib.contextmanager
def interruptible() -> Iterator[threading.Event]:
    """Ctrl-C sets an event instead of raising: the reply loop stops between tokens, never mid-forward
    (which would leave the cache half-updated)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatSession:
    """The turn loop: read a line, run a slash command or a reply, render through the UI classes."""

    def __init__(self, loaded: Loaded, options: RunOptions, console: Console, prompt_session=None):
        self.loaded = loaded
        self.options = options
        self.console = console
        self.conv = Conversation(loaded, options.policy, options.settings)
        plain = bool(os.environ.get("NO_COLOR"))  # the README promises plain text: no boxed panel
        self.panel = PanelView(loaded.spec.name, describe_device(loaded), plain=plain) if options.panel else None
        self.prompt = prompt_session
        self.heavy_ratio = getattr(options.policy, "heavy_ratio", 0.5)
        # policy and budget are independent settings: the budget is remembered while `full` (none) is active
        self.budget = options.policy.budget or 512

    # -- input ------------------------------------------------------------------------------------
    def toolbar(self, width: int | None = None) -> str:
        """The bottom bar: as many figures as fit the terminal's width (the least important go first), never
        cut mid-word; `/help` stays."""
        if width is None:
            from prompt_toolkit.application import get_app_or_none

            app = get_app_or_none()
            width = app.output.get_size().columns if app is not None else 120
        s = self.conv.cache.stats()
        short = s.policy if s.budget is None else f"{s.policy} {s.budget}"
        parts = [
            describe_policy(s) if width >= COMPACT_BELOW else short,
            f"{s.seen} seen, {s.kept:.0f} kept",
            f"{s.evicted:.0f} evicted",
            f"KV {human_bytes(s.kv_bytes)} allocated, {human_bytes(s.kv_used_bytes)} in use",
            f"full cache {human_bytes(s.full_kv_bytes)}",
        ]
        while len(parts) > 1 and len(" " + " | ".join([*parts, "/help"])) >= width:
            parts.pop()
        return " " + " | ".join([*parts, "/help"])

    def run(self) -> None:
        self.console.print(
            f"[bold]h2o-chat[/] {self.loaded.spec.name} on {describe_device(self.loaded)} | "
            f"{self.conv.policy.describe()} | /help for commands, Ctrl-D to leave"
        )
        while True:
            try:
                text = self.prompt.prompt()
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            text = text.strip()
            if not text:
                continue
            self.echo(text)
            if text.startswith("/"):
                if self.command(text) == "exit":
                    break
                continue
            self.reply(text)

    def echo(self, text: str) -> None:
        """Print what was sent, whole, for the scrollback. prompt-toolkit erases its own copy (erase_when_done):
        a paste taller than the terminal is drawn only in part, and the part was left in the scrollback twice
        (once scrolled off as the input grew, once as the final state), without its first paragraphs."""
        self.console.print(Text.assemble(("> ", "bold"), text), soft_wrap=True)

    # -- a reply ----------------------------------------------------------------------------------
    def reply(self, text: str) -> None:
        before = self.conv.cache.stats().evicted
        if self.panel is not None:
            self.panel.turn = TurnStats(evicted_at_start=before, decode=self.conv.engine.describe())
        last = None
        # a one-time capture or compilation of the decode step: say what the pause is
        self.conv.engine.on_setup = lambda message: self.console.print(f"[dim]{escape(message)} ...[/]")

        def progress(done: int, total: int) -> None:  # while the message (or a re-read conversation) is read
            for notice in self.conv.cache.pop_notices():
                self.console.print(f"[dim]note: {escape(notice)}[/]")
            n = self.conv.pending_messages
            what = f"reading the conversation ({n} messages)" if n > 1 else "reading your message"
            label = reading_label(total, self.conv.pending).replace("reading the prompt", what)
            view.prefill(done, total, label, self.conv.cache.stats)

        try:
            with (
                interruptible() as stop,
                StreamView(self.console, self.panel) as view,
                contextlib.closing(self.conv.send(text, progress=progress)) as stream,
            ):
                for r in stream:
                    last = r
                    if self.panel is not None:
                        self.panel.turn.prompt_tps, self.panel.turn.generation_tps = r.prompt_tps, r.generation_tps
                        self.panel.turn.decode = self.conv.engine.describe()
                    view.update(r.text, r.cache.stats)
                    if stop.is_set():
                        break
        except H2OChatError as e:  # e.g. a model that cannot read past its context: the session stays
            self.console.print(f"[red]error:[/] {e}")
            return
        finally:
            for notice in self.conv.cache.pop_notices():
                self.console.print(f"[dim]note: {notice}[/]")
        if stop.is_set():
            self.console.print("[dim](reply stopped)[/]")
        elif last is not None and last.finish_reason == "length":
            self.console.print(f"[dim](reply cut at {last.generation_tokens} tokens: --max-new-tokens)[/]")
        fresh = self.conv.newly_evicted_user_messages()
        if len(fresh) > 1:  # e.g. a long loaded conversation read into a small budget: one line, not one each
            self.console.print(
                f"[dim]note: {len(fresh)} of your earlier messages are no longer fully cached; /evicted shows which[/]"
            )
        for report in fresh if len(fresh) == 1 else ():
            self.console.print(
                f'[dim]note: your message "{escape(report.preview)}" is no longer fully cached '
                f"({100 * report.kept:.0f}% kept); /evicted shows more[/]"
            )

    # -- slash commands ---------------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        handler = getattr(self, "cmd_" + name[1:].lower(), None)
        if handler is None:
            self.console.print(f"unknown command {name}; /help lists the commands")
            return None
        try:
            return handler(arg)
        except H2OChatError as e:
            self.console.print(f"[red]error:[/] {e}")
            return None

    def cmd_help(self, arg: str) -> None:
        self.console.print(HELP, markup=False)

    def cmd_exit(self, arg: str) -> str:
        return "exit"

    cmd_quit = cmd_exit

    def _set_policy(self, name: str, budget: int | None) -> None:
        from h2o_chat.engine.policies import make_policy, with_budget

        old = self.conv.policy
        if name == old.name and old.budget is not None:  # a new budget: keep the other settings (sinks, window)
            policy = with_budget(old, budget)
        else:
            policy = make_policy(name, budget, heavy_ratio=self.heavy_ratio)
        before = self.conv.cache.stats().evicted
        self.conv.set_policy(policy)
        if policy.budget is not None:
            self.budget = policy.budget
        dropped = self.conv.cache.stats().evicted - before
        extra = f"; evicted {dropped:.0f} tokens now" if dropped else ""
        self.console.print(f"cache: {policy.describe()}{extra}")

    def cmd_budget(self, arg: str) -> None:
        if not arg:
            self.console.print(f"cache: {self.conv.policy.describe()}")
            return
        try:
            budget = int(arg)
        except ValueError:
            raise InputError(f"/budget takes a number of tokens, got {arg!r}") from None
        name = self.conv.policy.name
        self._set_policy(DEFAULT_POLICY if name == "full" else name, budget)

    def cmd_policy(self, arg: str) -> None:
        if not arg:
            self.console.print(f"cache: {self.conv.policy.describe()}")
            return
        self._set_policy(arg, self.budget)

    def cmd_system(self, arg: str) -> None:
        if not arg:
            current = next((m["content"] for m in self.conv.messages if m["role"] == "system"), None)
            self.console.print(f"system prompt: {current!r}" if current else "no system prompt")
            return
        self.conv.set_system(arg)
        self.console.print("system prompt set; the conversation is re-read on the next turn")

    def cmd_reset(self, arg: str) -> None:
        self.conv.reset()
        self.console.print("conversation reset")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise InputError("/save needs a file name")
        path = self.conv.save(arg)
        self.console.print(f"saved {len(self.conv.messages)} messages to {path}")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise InputError("/load needs a file name")
        count = self.conv.load(arg)
        self.console.print(f"loaded {count} messages from {arg}; they are read into the cache on the next turn")

    def cmd_stats(self, arg: str) -> None:
        panel = self.panel or PanelView(self.loaded.spec.name, describe_device(self.loaded))
        self.console.print(panel.render(self.conv.cache.stats()))

    def cmd_evicted(self, arg: str) -> None:
        reports = self.conv.evictions()
        if not reports:
            self.console.print("nothing cached yet")
            return
        self.console.print(eviction_table(reports))


def make_prompt_session(history: Path | None, chat: ChatSession, **kwargs):
    """prompt-toolkit input: persistent history, Alt-Enter for a new line, stats in the bottom toolbar."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.layout.dimension import Dimension

    path = (history or user_data_dir() / "history").expanduser()
    try:  # a read-only home must not end the session that has just loaded its model
        path.parent.mkdir(parents=True, exist_ok=True)
        path.open("a", encoding="utf-8").close()
        past = FileHistory(str(path))
    except OSError as e:
        chat.console.print(
            f"[dim]note: input history is off for this session: cannot write {escape(str(path))} ({e.strerror})[/]",
            soft_wrap=True,
        )
        past = InMemoryHistory()
    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    class Prompt(PromptSession):
        def _get_default_buffer_control_height(self):
            """The input stays below the terminal's height (a long paste scrolls inside it). An input area of
            the terminal's full height is cleared from the top-left corner when it is done, and terminals such
            as tmux (scroll-on-clear) then push the whole screen into the scrollback: a second, partial copy
            of the paste above the session's own echo of it."""
            height = super()._get_default_buffer_control_height()
            rows = self.app.output.get_size().rows
            return Dimension(min=height.min, max=max(1, min(height.max, rows - 4)))

    return Prompt(
        message="> ",
        history=past,
        key_bindings=keys,
        multiline=False,
        bottom_toolbar=chat.toolbar if chat.panel is not None else None,
        erase_when_done=True,  # the session echoes the whole input itself (ChatSession.echo)
        **kwargs,
    )


def run_interactive(loaded: Loaded, options: RunOptions, history: Path | None = None) -> None:
    console = make_console()
    chat = ChatSession(loaded, options, console)
    chat.prompt = make_prompt_session(history, chat)
    chat.run()
