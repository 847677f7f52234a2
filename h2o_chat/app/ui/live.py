"""The live chat view: the stats panel (boxed, or two plain lines below 80 columns) and the streamed reply
below it, redrawn as records arrive."""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from h2o_chat.app.ui.progress import ProgressBar, progress_display
from h2o_chat.app.ui.text import (
    COMPACT_BELOW,
    NOT_TIMED,
    describe_kv,
    describe_policy,
    describe_store,
    fit,
    human_bytes,
)


@dataclass
class TurnStats:
    """What the panel shows about the current turn."""

    evicted_at_start: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float | None = 0.0  # None: no decode step has run yet (the first token is the prompt's)
    decode: str = ""  # how decode steps run: eager or CUDA graph (captured)
    reading_tps: float = 0.0  # tokens read per second so far, while the message is read (before any speed is known)

    def speed(self, compact: bool = False) -> str:
        """The turn's speeds; while the message is read, the reading speed so far (or nothing), not zeros."""
        if not (self.prompt_tps or self.generation_tps):
            if not self.reading_tps:
                return ""
            return f"reading {self.reading_tps:,.0f} tok/s" + ("" if compact else " so far")
        if self.generation_tps is None:
            return f"prefill {self.prompt_tps:.0f} tok/s" + ("" if compact else f", {NOT_TIMED}")
        if compact:
            return f"{self.prompt_tps:.0f}/{self.generation_tps:.1f} tok/s"
        return f"prefill {self.prompt_tps:.0f} tok/s, decode {self.generation_tps:.1f} tok/s" + (
            f" ({self.decode})" if self.decode else ""
        )


PANEL_FRAME = 4 + len("positions") + 2  # columns of the boxed panel that are not a value: borders, labels, gap


@dataclass
class PanelView:
    """The live panel: model, device, policy, budget split, tokens, evictions, memory, speed.

    It lays itself out for the width it is drawn at: a boxed panel with one line per figure, or, below
    COMPACT_BELOW columns and whenever `plain` (NO_COLOR), two plain lines. Every line is cut, never wrapped,
    so the panel keeps its height as the figures change (a live area that grows at the bottom of the screen
    pushes its top lines into the scrollback)."""

    model: str
    device: str
    turn: TurnStats = field(default_factory=TurnStats)
    plain: bool = False
    memory: Callable[[], dict[str, int]] = field(default=lambda: {"rss": 0})  # the process's memory, in bytes

    def render(self, stats) -> _Panel:
        return _Panel(self, stats, self.memory())

    def entries(self, stats, mem: dict, width: int = 200) -> list[tuple[str, str]]:
        """The boxed panel's (label, value) rows for a panel `width` columns wide."""
        memory = f"RSS {human_bytes(mem['rss'])}"
        if "gpu_allocated" in mem:
            memory += (
                f" | GPU {human_bytes(mem['gpu_allocated'])} alloc, {human_bytes(mem['gpu_reserved'])} "
                f"reserved, KV {100 * stats.kv_bytes / max(1, mem['gpu_allocated']):.0f}%"
            )
        rows = [
            ("model", f"{self.model} on {self.device}"),
            ("policy", describe_policy(stats)),
            ("tokens", f"{stats.seen} seen, {stats.kept:.0f} kept per layer and head"),
            ("positions", stats.positions),
            ("evicted", self._evicted(stats, width=width - PANEL_FRAME)),
            ("KV cache", describe_kv(stats, width - PANEL_FRAME)),
            ("memory", memory),
            ("speed", self.turn.speed()),
        ]
        return [(label, fit(value, width - PANEL_FRAME)) for label, value in rows]  # the grid would cut mid-word

    def _evicted(self, stats, compact: bool = False, width: int | None = None) -> str:
        """Evictions this turn and in all; with recall, what its store keeps of them and what it dropped for good.
        `compact`: the two-line summary's wording; `width`: the columns the panel's row has (the first wording that
        fits)."""
        total, turn = f"{stats.evicted:.0f}", f"{stats.evicted - self.turn.evicted_at_start:.0f}"
        if compact:
            return f"{turn} evicted ({total} total)"
        if not stats.store_bytes:
            return f"{turn} this turn, {total} total"
        kept = f"{human_bytes(stats.store_bytes)} kept for recall"
        dropped = f", {stats.store_dropped:,.0f} dropped" if stats.store_dropped else ""
        short = f"{stats.store_tokens:,.0f}/{stats.store_capacity:,}{dropped}"
        forms = [
            f"{turn} this turn, {total} total; {kept}: {describe_store(stats)}",
            f"{turn} now, {total} in all; {kept} ({short})",
            f"{turn} now; {kept} ({short})",
        ]
        return forms[0] if width is None else next((f for f in forms if len(f) <= width), forms[-1])

    def lines(self, stats, mem: dict, width: int = 200) -> list[str]:
        """The summary for narrow terminals and NO_COLOR: the figures, most important first, filled into two
        lines of at most `width` columns; what does not fit is left out, never wrapped."""
        policy = describe_policy(stats) if width >= 60 or stats.budget is None else f"{stats.policy} {stats.budget}"
        parts = [
            policy,
            f"{stats.seen} seen, {stats.kept:.0f} kept",
            f"KV {human_bytes(stats.kv_bytes)} alloc, {human_bytes(stats.kv_used_bytes)} used",
            self._evicted(stats, compact=True),
            f"full cache {human_bytes(stats.full_kv_bytes)}",
            f"RSS {human_bytes(mem['rss'])}",
            self.turn.speed(compact=True),
        ]
        lines: list[str] = [""]
        for part in filter(None, parts):
            joined = f"{lines[-1]} | {part}" if lines[-1] else part
            if len(joined) <= width:
                lines[-1] = joined
            elif len(lines) < 2:
                lines.append(part)
        return lines


@dataclass
class _Panel:
    """A PanelView's figures, laid out when the console says how wide it is."""

    view: PanelView
    stats: object
    mem: dict

    def __rich_console__(self, console: Console, options):
        if self.view.plain or options.max_width < COMPACT_BELOW:
            for line in self.view.lines(self.stats, self.mem, options.max_width):
                yield Text(line, no_wrap=True, overflow="ellipsis", style="dim" if not self.view.plain else "")
            return
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True, min_width=len("positions"))
        grid.add_column(no_wrap=True, overflow="ellipsis")
        for label, value in self.view.entries(self.stats, self.mem, options.max_width):
            grid.add_row(label, value)
        yield Panel(grid, title="h2o-chat", title_align="left", border_style="dim")


def _no_echo():
    """Stop the terminal echoing keys (Ctrl-C's "^C" above all) while the live area is drawn; returns the undo.

    The live area's last line fills the terminal's width, so an echoed "^C" wrapped onto a new line: the
    redraw that clears the live area then went up one line short and left the line being written on screen,
    and the reply's last line was printed twice. Keys typed meanwhile still reach the next prompt."""
    try:
        import termios
    except ImportError:  # Windows
        return lambda: None
    try:
        fd = sys.stdin.fileno()
        before = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):  # no terminal on stdin (tests, pipes)
        return lambda: None
    quiet = list(before)
    quiet[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    return lambda: termios.tcsetattr(fd, termios.TCSANOW, before)


class StreamView:
    """Streams a reply. On a terminal with a panel: finished lines are printed for good, and a live area
    holds only the line being written plus the panel, so replies of any length scroll normally.
    Otherwise (no panel, or not a terminal): plain text as it comes."""

    def __init__(self, console: Console, panel: PanelView | None, min_progress: int = 256):
        self.console = console
        self.panel = panel if console.is_terminal else None
        self.partial = ""
        self.live: Live | None = None
        self.stats_fn = None
        self.drawn = 0.0  # when the live area was last redrawn
        self.min_progress = min_progress  # prompts shorter than this read without a bar
        self.reading: Progress | None = None  # the prompt-reading bar, shown until the first text
        self.bar: ProgressBar | None = None  # the same without a live panel
        self.at_line_start = True  # plain text: whether what was written so far ends a line

    def prefill(self, done: int, total: int, description: str, stats_fn=None) -> None:
        """Show how far the prompt has been read (before the reply's first text): in the live area above the
        panel, or as a bar of its own on a terminal without the panel."""
        if self.live is None:
            if self.bar is None:
                self.bar = ProgressBar(self.console, description, self.min_progress)
            self.bar.description = description
            self.bar(done, total)
            return
        if self.reading is None:
            self.reading = progress_display(self.console)
            self.task = self.reading.add_task(description, total=total)
        self.reading.update(self.task, completed=done, total=total, description=description)
        if stats_fn is not None:
            self.stats_fn = stats_fn
        parts = [self.reading] + ([self.panel.render(self.stats_fn())] if self.stats_fn else [])
        self.live.update(Group(*parts), refresh=True)

    def __enter__(self) -> StreamView:
        if self.panel is not None:
            self._quiet = _no_echo()
            self.live = Live(console=self.console, refresh_per_second=8, transient=True)
            self.live.__enter__()
        return self

    def update(self, piece: str, stats_fn) -> None:
        """Show a new piece of text; `stats_fn()` gives the cache stats, asked for only when redrawn."""
        if self.bar is not None:  # the prompt is read: the bar gives way to the reply
            self.bar.close()
            self.bar = None
        self.reading = None
        if self.live is None:
            self.console.file.write(piece)
            self.console.file.flush()
            if piece:
                self.at_line_start = piece.endswith("\n")
            return
        self.stats_fn = stats_fn
        self.partial += piece
        *done, self.partial = self.partial.split("\n")
        for line in done:
            self.console.print(Text(line), soft_wrap=True)
        width = max(20, self.console.width)
        if len(self.partial) > width:  # flush the wrapped rows of a long paragraph, keep the last one live
            rows = textwrap.wrap(self.partial, width, drop_whitespace=False, replace_whitespace=False)
            for row in rows[:-1]:
                self.console.print(Text(row), soft_wrap=True)
            self.partial = rows[-1]
        now = time.monotonic()
        if now - self.drawn > 0.1:
            self.drawn = now
            self.live.update(Group(Text(self.partial), self.panel.render(stats_fn())))

    def break_line(self) -> None:
        """Before a line of ours in the middle of a reply: plain text that has not ended its line ends it (with
        the live panel the reply's open line lives in the live area, below what is printed)."""
        if self.live is None and not self.at_line_start:
            self.console.file.write("\n")
            self.console.file.flush()
            self.at_line_start = True

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.live is not None:
            self.live.__exit__(*exc)
            self._quiet()
            if self.partial:
                self.console.print(Text(self.partial), soft_wrap=True)
            if self.stats_fn is not None:
                self.console.print(self.panel.render(self.stats_fn()))
        else:
            self.console.file.write("\n")
            self.console.file.flush()
