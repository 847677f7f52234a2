"""What the chat session shows: the banner, the echo of each input, replies streaming above the live panel,
notes, errors, the toolbar. Rendering only: the session and the slash commands hand it what to show."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from h2o_chat.app.ui import (
    COMPACT_BELOW,
    PanelView,
    StreamView,
    TurnStats,
    describe_policy,
    eviction_table,
    human_bytes,
    plural,
    reading_label,
    share,
    wrap,
)


class ChatView:
    """The chat's rendering on a rich console, with the live panel (or None for plain text)."""

    def __init__(
        self,
        console: Console,
        panel: PanelView | None,
        model: str,
        device: str,
        memory: Callable[[], dict[str, int]] | None = None,
    ):
        self.console, self.panel, self.model, self.device = console, panel, model, device
        self.memory = memory or (panel.memory if panel is not None else lambda: {"rss": 0})
        self.stream: StreamView | None = None
        self.hinted = False  # told once that `recall` keeps what is evicted
        self.read_from = 0.0  # when the message being read started (for the reading speed)

    # -- lines --------------------------------------------------------------------------------------
    # our own lines wrap at word boundaries to the terminal's width; a line said while a reply streams
    # starts on a line of its own, never glued to the reply's text
    def banner(self, policy: str) -> None:
        wrap(
            self.console,
            f"[bold]h2o-chat[/] {escape(self.model)} on {escape(self.device)} | {escape(policy)} | "
            "/help for commands, Ctrl-D to leave",
        )

    def echo(self, text: str) -> None:
        """Print what was sent, whole, for the scrollback. prompt-toolkit erases its own copy (erase_when_done):
        a paste taller than the terminal is drawn only in part, and the part was left in the scrollback twice
        (once scrolled off as the input grew, once as the final state), without its first paragraphs."""
        self.console.print(Text.assemble(("> ", "bold"), text), soft_wrap=True)

    def _line(self, renderable, **kwargs) -> None:
        if self.stream is not None:
            self.stream.break_line()
        wrap(self.console, renderable, **kwargs)

    def say(self, text: str) -> None:
        self._line(text, markup=False, highlight=False)

    def note(self, text: str) -> None:
        self._line(f"[dim]note: {escape(text)}[/]")

    def error(self, error: Exception | str) -> None:
        self._line(f"[red]error:[/] {escape(str(error))}")

    def clear(self) -> None:
        """/clear: an empty screen (the conversation and the scrollback above it stay)."""
        self.console.clear()

    def setup(self, message: str) -> None:
        """A one-time capture or compilation of the decode step: say what the pause is."""
        self._line(f"[dim]{escape(message)} ...[/]")

    # -- panels and tables --------------------------------------------------------------------------
    def toolbar(self, stats, width: int) -> str:
        """The bottom bar: as many figures as fit the terminal's width (the least important go first), never
        cut mid-word; `/help` stays."""
        short = stats.policy if stats.budget is None else f"{stats.policy} {stats.budget}"
        parts = [
            describe_policy(stats) if width >= COMPACT_BELOW else short,
            f"{stats.seen} seen, {stats.kept:.0f} kept",
            f"{stats.evicted:.0f} evicted",
            f"KV {human_bytes(stats.kv_bytes)} allocated, {human_bytes(stats.kv_used_bytes)} in use",
            f"full cache {human_bytes(stats.full_kv_bytes)}",
        ]
        while len(parts) > 1 and len(" " + " | ".join([*parts, "/help"])) >= width:
            parts.pop()
        return " " + " | ".join([*parts, "/help"])

    def stats(self, stats) -> None:
        panel = self.panel or PanelView(self.model, self.device, memory=self.memory)
        self.console.print(panel.render(stats))

    def evictions(self, reports) -> None:
        self.console.print(eviction_table(reports) if reports else "nothing cached yet")

    # -- a reply ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reply(self, evicted_before: float, decode: str) -> Iterator[StreamView]:
        """The live area of one reply: streamed text above the panel."""
        if self.panel is not None:
            self.panel.turn = TurnStats(evicted_at_start=evicted_before, decode=decode)
        with StreamView(self.console, self.panel) as stream:
            self.stream = stream
            try:
                yield stream
            finally:
                self.stream = None

    def reading(self, done: int, total: int, pending: int, messages: int, stats_fn) -> None:
        """Progress while the message (or a whole conversation, after a restart) is read."""
        what = f"reading the conversation ({messages} messages)" if messages > 1 else "reading your message"
        label = reading_label(total, pending).replace("reading the prompt", what)
        if self.panel is not None:  # the panel shows the reading speed so far, not the last turn's zeros
            now = time.monotonic()
            if not done:
                self.read_from = now
            elapsed = now - self.read_from
            self.panel.turn.reading_tps = done / elapsed if done and elapsed > 0 else 0.0
        self.stream.prefill(done, total, label, stats_fn)

    def token(self, record, decode: str, speeds: tuple[float, float, float] | None = None, stats_fn=None) -> None:
        """A piece of the reply; `speeds` (prompt tok/s, decode tok/s, setup seconds) leave a one-time setup out;
        `stats_fn` gives the panel's figures (the record's cache stats when None)."""
        if self.panel is not None:
            prompt_tps, decode_tps, _ = speeds or (record.prompt_tps, record.generation_tps, 0.0)
            self.panel.turn.prompt_tps, self.panel.turn.generation_tps = prompt_tps, decode_tps
            self.panel.turn.decode = decode
        self.stream.update(record.text, stats_fn or record.cache.stats)

    def reply_ended(self, stopped: bool, last, fresh, recalls: bool = True, recall: str | None = None) -> None:
        """How the reply ended, and which of the user's earlier messages have fallen below a share that matters
        (WARN_BELOW); the first time, in a chat whose policy cannot bring evicted tokens back (`recalls` False),
        how to keep them. `recall`: what the turn recalled (recall), said only when no message is: one note a turn."""
        if stopped:
            self.console.print("[dim](reply stopped)[/]")
        elif last is not None and last.finish_reason == "length":
            wrap(self.console, f"[dim](reply cut at {plural(last.generation_tokens, 'token')}: --max-new-tokens)[/]")
        if not fresh:
            if recall:
                self.note(recall)
            return
        hint = "; a larger /budget keeps more"
        if not recalls and not self.hinted:
            self.hinted = True
            hint = "; /policy recall keeps what is evicted from now on, for a later question to bring back"
        lowest = min(r.kept for r in fresh)
        if len(fresh) > 1:  # e.g. a long loaded conversation read into a small budget: one line, not one each
            self.note(
                f"{len(fresh)} of your earlier messages are now {'under a tenth' if lowest < 0.1 else 'under half'} "
                f"cached: say again what matters; /evicted shows which{hint}"
            )
            return
        gone = "the model has mostly lost it" if lowest < 0.1 else "the model sees only part of it"
        self.note(
            f'your message "{fresh[0].preview}" is {share(fresh[0].kept)} cached: {gone}; say again what matters{hint}'
        )
