"""Rendering only: the live stats panel, streamed text, summaries. It is handed records and prints them.

Nothing here decides anything about generation; the chat loop and the CLI call in with what to show.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Column, Table
from rich.text import Text

LOG_EVERY = 60.0  # seconds between the progress lines of a measurement whose stderr is not a terminal


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def share(fraction: float) -> str:
    """A share as a whole percent, rounded down: a message that lost a token reads 99%, never 100%."""
    return "100%" if fraction >= 1 - 1e-6 else f"{min(99, math.floor(100 * fraction))}%"


def quote(text: str, width: int = 48) -> str:
    """`text` on one line in at most `width` characters, cut between words and marked with "…" (a cut inside a
    word or a number misquotes it: "costs 12" for "costs 1250")."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    cut = flat.rfind(" ", 0, width)
    return (flat[:cut] if cut > 0 else flat[: width - 1]) + "…"


def fit(text: str, width: int) -> str:
    """`text` in `width` columns, never cut inside a word: whole clauses (before ", ", "; ", " (", " | ") leave
    from the end while what stays fills at least half the width, else whole words; " …" marks the cut."""
    if len(text) <= width:
        return text
    room = width - 2  # for " …"
    clause = max(text.rfind(sep, 0, room + 1) for sep in (", ", "; ", " (", " | "))
    cut = clause if clause >= width // 2 else text.rfind(" ", 0, room + 1)
    if cut <= 0:  # one word longer than the width
        return text[: width - 1] + "…"
    return text[:cut].rstrip(" ,;|(") + " …"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 token', '2 tokens', '1,024 tokens'."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def reading_label(total: int, prompt_tokens: int) -> str:
    """What a prompt-reading bar says: snap's probe reads a prompt that overflows the budget first, then the
    prompt is read again, so one bar counts both passes."""
    if not prompt_tokens or total <= prompt_tokens:
        return "reading the prompt"
    return "reading the prompt (twice: snap)"


NOT_TIMED = "no decode step to time"  # a 1-token reply: its token comes from the prompt's reading


def summary_line(
    response, stats, decode: str = "", speeds: tuple[float, float, float] | None = None, weights: str = ""
) -> str:
    """One line for stderr after a piped run; `decode` says how decode steps ran (eager, CUDA graph, ...);
    `speeds` are (prompt tok/s, decode tok/s or None when no decode step ran, one-time setup seconds) with the
    setup (a capture or compilation) left out of both speeds, which is then stated apart."""
    prompt_tps, decode_tps, setup = speeds or (response.prompt_tps, response.generation_tps, 0.0)
    steps = f", {decode}" if decode else ""
    rate = NOT_TIMED if decode_tps is None else f"{decode_tps:.1f} tok/s{steps}"
    once = f"; one-time setup {setup:.1f} s, not in tok/s" if setup >= 0.05 else ""
    return (
        f"{plural(response.generation_tokens, 'token')}, {rate} "
        f"(prompt {plural(response.prompt_tokens, 'token')}, {prompt_tps:.0f} tok/s{once}) | "
        f"cache {describe_policy(stats)}: kept {stats.kept:.0f} of {stats.seen} seen, "
        f"evicted {stats.evicted:.0f} | KV {describe_kv(stats)}" + (f" | weights {weights}" if weights else "")
    )


def describe_kv(stats, width: int | None = None) -> str:
    """What the KV cache allocated (the whole budget, from the first token), what the held tokens use, and
    what a full cache would hold for the same tokens: e.g. '22.5 MB allocated, 2.0 MB in use; a full cache
    would hold 2.0 MB'. Allocated alone beside the full figure made H2O look worse than no eviction. `width`:
    the columns it has (the panel's row): the first wording that fits, down to 'alloc'/'used'/'full'; with it the
    recall store is left to the evicted row."""
    held = " in 8 bits" if stats.kv_quant == "8bit" else ""
    alloc, used, full = human_bytes(stats.kv_bytes), human_bytes(stats.kv_used_bytes), human_bytes(stats.full_kv_bytes)
    share = ""
    if stats.full_kv_bytes and stats.kv_bytes < stats.full_kv_bytes:
        share = f"{100 * stats.kv_bytes / stats.full_kv_bytes:.0f}%"
    forms = [
        f"{alloc} allocated{held}, {used} in use; a full cache would hold {full}"
        + (f" ({share} allocated)" if share else ""),
        f"{alloc} allocated{held}, {used} in use; full cache {full}" + (f" ({share})" if share else ""),
        f"{alloc} alloc{held}, {used} used; full {full}" + (f" ({share})" if share else ""),
    ]
    if width is not None:
        return next((form for form in forms if len(form) <= width), forms[-1])
    kv = forms[0]
    if stats.store_bytes:  # recall: the store of evicted tokens, allocated once beside the slots
        kv += f"; evicted tokens kept for recall {human_bytes(stats.store_bytes)} ({describe_store(stats)})"
    return kv


def describe_store(stats) -> str:
    """What recall's store holds: '1,234 of 4,096 tokens, 10 dropped' (per layer, row and head)."""
    dropped = f", {stats.store_dropped:,.0f} dropped" if stats.store_dropped else ""
    return f"{stats.store_tokens:,.0f} of {stats.store_capacity:,} tokens{dropped}"


def describe_policy(stats) -> str:
    if stats.budget is None:
        return stats.policy
    split = " + ".join(f"{v} {k}" for k, v in stats.split.items() if v)
    return f"{stats.policy} {stats.budget} ({split})"


def make_console(stderr: bool = False) -> Console:
    """Rich console honouring NO_COLOR; plain when not a terminal. Text is not wrapped unless asked for
    (`wrap` below): streamed replies and echoed input keep their own lines."""
    return Console(stderr=stderr, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, soft_wrap=True)


def wrap(console: Console, renderable, **kwargs) -> None:
    """Print a line of ours (a banner, a note, a status line) wrapped at word boundaries to the terminal's
    width, so that the terminal never cuts it mid-word; pipes and files keep it on one line."""
    console.print(renderable, soft_wrap=not console.is_terminal, **kwargs)


# -- progress of long loops ----------------------------------------------------------------------------------
class _Speed(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.1f} tok/s" if speed else "", style="progress.data.speed")


def _progress(console: Console) -> Progress:
    """A bar laid out for the console's width: below COMPACT_BELOW columns the bar and the speed give way, and
    the description wraps at word boundaries (never cut by the terminal)."""
    label = TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=False, overflow="fold"))
    if console.width < COMPACT_BELOW:
        columns = [label, MofNCompleteColumn(), TextColumn("tokens"), TimeRemainingColumn()]
    else:
        columns = [label, BarColumn(bar_width=24), MofNCompleteColumn(), TextColumn("tokens"), _Speed()]
        columns += [TextColumn("ETA"), TimeRemainingColumn()]
    return Progress(
        *columns,
        console=console,
        transient=True,  # gone when done: the scrollback keeps the results, not the bar
        redirect_stdout=False,  # piped text goes to stdout itself, never through the bar
        redirect_stderr=False,
    )


class ProgressBar:
    """Renders a long loop's `(done, total)` callbacks as a rich progress bar (tokens read / total, tok/s, ETA)
    on `console` when that console is a terminal. The bar appears at the first call whose total reaches
    `min_total` (short prompts do not flash one) and is removed by `close()`. `description` may be a callable of
    (done, total) for a label that depends on them. Elsewhere (a pipe, a file, a CI log) nothing is drawn, unless
    `every` is given: then a plain line with the share done and the time left, at most once per `every` seconds
    (a measurement that runs for an hour into a log must not look hung)."""

    def __init__(self, console: Console, description="working", min_total: int = 0, every: float | None = None):
        self.console, self.description, self.min_total = console, description, min_total
        self.enabled = console.is_terminal
        self.every = None if self.enabled else every
        self.progress: Progress | None = None
        self.task = None
        self.started = self.last = time.monotonic()

    def label(self, done: int, total: int) -> str:
        return self.description(done, total) if callable(self.description) else self.description

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            if self.every is not None and 0 < done < total and time.monotonic() - self.last >= self.every:
                self._line(done, total)
            return
        if self.progress is None:
            if total < self.min_total:
                return
            self.progress = _progress(self.console)
            self.task = self.progress.add_task(self.label(done, total), total=total)
            self.progress.start()
        self.progress.update(self.task, completed=done, total=total, description=self.label(done, total))

    def _line(self, done: int, total: int) -> None:
        self.last = now = time.monotonic()
        left = (now - self.started) / done * (total - done)
        self.print(f"{self.label(done, total)}: {done:,}/{total:,} ({done / total:.0%}), about {duration(left)} left")

    def print(self, message: str) -> None:
        """A status line for stderr, printed above the bar while it is drawn (a raw write would tear it)."""
        wrap(self.console, f"h2o-chat: {message}", markup=False, highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(description: str, min_total: int = 0, every: float = LOG_EVERY) -> ProgressBar:
    """A bar on stderr for the measurement commands (when stderr is not a terminal: a line every `every` s)."""
    return ProgressBar(make_console(stderr=True), description, min_total, every)


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


COMPACT_BELOW = 80  # columns: below this the panel is two plain lines
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
            self.reading = _progress(self.console)
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


def describe_device(loaded) -> str:
    """e.g. 'cpu, float32' or 'cuda:0 NVIDIA H100, 4bit (bfloat16 compute)'."""
    device = loaded.device
    name = str(device)
    if device.type == "cuda":
        import torch

        name += " " + torch.cuda.get_device_name(device)
    dtype = str(loaded.dtype).removeprefix("torch.")
    if loaded.quantize != "none":
        return f"{name}, {describe_weights(loaded)}, {dtype} compute"
    return f"{name}, {describe_weights(loaded)}"


def describe_weights(loaded) -> str:
    """The weights' format and bytes as held: e.g. 'int4 groups of 32, int8 embedding, 141 MB'."""
    size = f", {human_bytes(loaded.weight_bytes)}" if getattr(loaded, "weight_bytes", 0) else ""
    return f"{loaded.weights}{size}"


def eviction_table(reports) -> Table:
    """/evicted: each message the cache has seen and how much of it is still held."""
    table = Table(box=None, pad_edge=False)
    columns = [("#", "right"), ("role", "left"), ("tokens", "right"), ("kept", "right")]
    recalled = any(r.recalled for r in reports)  # the last turn recalled evicted tokens (recall): from where
    columns += [("recalled", "right")] if recalled else []
    for col, justify in (*columns, ("message", "left")):
        table.add_column(col, justify=justify)
    for r in reports:
        style = "" if r.kept >= 0.999 else ("yellow" if r.kept > 0.5 else "red")
        back = [f"{100 * r.recalled:.0f}%" if r.recalled else ""] if recalled else []
        table.add_row(str(r.index), r.role, str(r.tokens), share(r.kept), *back, r.preview, style=style)
    return table


def models_tables(rows: list[tuple[str, ...]], caption: str, width: int) -> list[Table]:
    """`h2o-chat models`: rows of (alias, present, family, dtype/quant, context, source, note). A source (a repo
    id, a path) has no space to wrap at and is never cut: it gets a column as wide as the longest one, beside the
    other columns when `width` allows, else in a second table of its own (alias, source / note)."""
    header = ["alias", "present", "family", "dtype/quant", "context"]
    widths = [max(len(r[i]) for r in [header, *rows]) + 2 for i in range(len(header))]
    longest = max(len(r[5]) for r in rows)
    beside = sum(widths) + longest <= width
    tables = [Table(box=None, pad_edge=False)]
    for col in header:
        tables[0].add_column(col, no_wrap=True)
    if not beside:
        tables.append(Table(box=None, pad_edge=False))
        tables[1].add_column("alias", no_wrap=True)
    tables[-1].add_column("source / note", min_width=longest)
    for row in rows:
        source = Text(f"{row[5]}\n{row[6]}", overflow="fold")
        if beside:
            tables[0].add_row(*row[:5], source)
        else:
            tables[0].add_row(*row[:5])
            tables[1].add_row(row[0], source)
    tables[-1].caption = caption
    return tables


def bench_table(records, ratios, about: str = "") -> Group:
    """Decode speed and KV memory per configuration and length, then the measured ratios (only what was
    measured: a target beside each read like a failed run to users). `about`: the model, weights, threads."""
    configs = list(dict.fromkeys(r.config for r in records if r.config != "h2o@first"))
    title = "decode ms/token (median) | KV cache" + (f" ({about})" if about else "")
    table = Table(title=title, title_justify="left")
    table.add_column("seen", justify="right")
    for c in configs:
        first = next(r for r in records if r.config == c)
        label = c if first.budget is None or c == "h2o-nobound" else f"{c} {first.budget}"
        table.add_column(f"{label} ({first.decode})", justify="right")
    for length in sorted({r.measured_at for r in records}):
        row = [str(length)]
        for c in configs:
            rec = next((r for r in records if r.config == c and r.measured_at == length), None)
            row.append(f"{rec.ms_per_token:.2f} | {human_bytes(rec.kv_bytes)}" if rec else "")
        table.add_row(*row)
    # the h2o twin parked at the first length, timed in the last length's rounds beside the others: the flatness
    # ratio divides by it, so it is shown (a ratio over a figure the table hid contradicted the table)
    twin = max((r for r in records if r.config == "h2o@first"), key=lambda r: r.measured_at, default=None)
    if twin is not None and "h2o" in configs and twin.measured_at != twin.seen:
        cells = [f"{twin.ms_per_token:.2f} | {human_bytes(twin.kv_bytes)}" if c == "h2o" else "" for c in configs]
        table.add_row(f"{twin.seen} (twin)", *cells)
    setup = [f"{c} {r.setup_seconds:.1f} s" for c in configs for r in [next(x for x in records if x.config == c)]]
    setup = [s for s, c in zip(setup, configs, strict=True) if next(x for x in records if x.config == c).setup_seconds]
    caption = [f"one-time capture or compilation: {', '.join(setup)}"] if setup else []
    if twin is not None and "h2o" in configs and twin.measured_at != twin.seen:
        caption.append(f"twin: a second h2o cache kept at {twin.seen} seen, timed in the rounds of {twin.measured_at}")
    if caption:
        table.caption = "; ".join(caption)
    lines = Table(box=None, show_header=False)
    for text, value in ratios:
        lines.add_row(text, f"{value:.2f}x")
    return Group(table, lines)


def prefill_table(records, ratios, model: str) -> Group:
    """Reading one prompt: seconds, tokens/s, extra peak memory and operators per layer and chunk per row, then
    the ratios measured in the same run."""
    first = records[0]
    title = f"reading a {first.batch} x {first.prompt_tokens}-token prompt ({model}, {first.device}, {first.dtype})"
    table = Table(title=title, title_justify="left")
    for col in ("reader", "chunk", "seconds", "tokens/s", "extra peak", "ops/layer/chunk"):
        table.add_column(col, justify="left" if col == "reader" else "right")
    for r in records:
        label = r.config if r.budget is None else f"{r.config} {r.budget}"
        ops = f"{r.ops_per_layer:.0f}" if r.ops_per_layer else ""
        chunk = str(r.chunk) if r.chunk else "one pass"
        table.add_row(
            label, chunk, f"{r.seconds:.3f}", f"{r.tokens_per_second:,.0f}", human_bytes(r.extra_peak_bytes), ops
        )
    lines = Table(box=None, show_header=False)
    for text, value in ratios:
        lines.add_row(text, f"{value:.2f}x")
    return Group(table, lines)


def throughput_table(records, model: str) -> Table:
    """Tokens/s at the largest batch that fits the memory limit, full cache vs h2o."""
    limit = human_bytes(records[0].memory_limit) if records else "?"
    table = Table(title=f"generation throughput at {limit} ({model})", title_justify="left")
    for col in ("cache", "batch", "prompt+gen", "tokens/s", "KV", "peak memory"):
        table.add_column(col, justify="left" if col == "cache" else "right")
    for r in records:
        label = "full" if r.config == "full" else f"h2o {r.budget}"
        table.add_row(
            label,
            str(r.batch),
            f"{r.prompt_tokens}+{r.generated_tokens}",
            f"{r.tokens_per_second:.1f}",
            human_bytes(r.kv_bytes),
            human_bytes(r.peak_bytes),
        )
    full = next((r for r in records if r.config == "full"), None)
    h2o = next((r for r in records if r.config == "h2o"), None)
    if full and h2o and full.tokens_per_second:
        table.caption = (
            f"h2o / full throughput: {h2o.tokens_per_second / full.tokens_per_second:.2f}x "
            f"(both decoded by the same engine: {h2o.decode})"
        )
    return table


def rich_table(table) -> Table:
    """A measurement's (title, header, rows) table, drawn for the terminal."""
    title, header, rows = table
    out = Table(title=title, title_justify="left")
    for i, col in enumerate(header):
        out.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


def soak_table(records, model: str, policy: str, flatness: dict[str, float]) -> Group:
    """Per window (`policy`, e.g. "h2o 256"): tokens seen, process memory, perplexity per configuration; then memory
    flatness (max / min after the first window, per memory figure, as the soak measured it)."""
    labels = list(records[0]["ppl"]) if records else []
    table = Table(title=f"soak: {model}, {policy}: perplexity per window", title_justify="left")
    table.add_column("tokens", justify="right")
    table.add_column("RSS", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    for r in records:
        table.add_row(
            f"{r['window'][0]}-{r['window'][1]}", human_bytes(r["rss"]), *(f"{r['ppl'][k]:.2f}" for k in labels)
        )
    lines = Table(box=None, show_header=False)
    if len(records) > 1:
        lines.add_row("process memory after the first window: max / min", f"{flatness['rss']:.3f}")
        if "gpu_allocated" in flatness:
            lines.add_row("GPU memory after the first window: max / min", f"{flatness['gpu_allocated']:.3f}")
    return Group(table, lines)
