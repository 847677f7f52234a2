"""Progress of long work (a long paste's reading, eval, bench, soak): a bar on a terminal, a line every minute
elsewhere, so that nobody looks at a silent terminal."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from h2o_chat.app.ui.text import COMPACT_BELOW, duration, make_console, wrap

LOG_EVERY = 60.0  # seconds between the progress lines of a measurement whose stderr is not a terminal


class _Speed(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.1f} tok/s" if speed else "", style="progress.data.speed")


def progress_display(console: Console) -> Progress:
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
            self.progress = progress_display(self.console)
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
