"""How a command ends when something goes wrong: the errors users can cause as one line on stderr and a
non-zero exit (`reported`), a failed or closed stdout as one line too (`guard_stdout`, `require_stdout`,
`stdout_failed`), the status lines every command prints (`status`), and a long measurement's records written as
they finish and kept on Ctrl-C (`Finished`)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import typing
from collections.abc import Callable, Iterator

import typer

from h2o_chat.errors import H2OChatError, SettingError, StdoutError, out_of_memory


def flag(name: str) -> str:
    """The option that sets a library keyword: top_p -> --top-p."""
    return "--" + name.replace("_", "-")


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """Turn the errors users can cause into one line on stderr and a non-zero exit."""
    try:
        yield
    except SettingError as e:  # the library names the setting by its keyword; here it is an option
        typer.echo(f"h2o-chat: error: {e.worded(flag(e.name))}", err=True)
        raise typer.Exit(e.exit_code) from None
    except H2OChatError as e:
        typer.echo(f"h2o-chat: error: {e}", err=True)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:
        done = f" ({e})" if isinstance(e, Interrupted) else ""
        typer.echo(f"h2o-chat: interrupted{done}", err=True)
        raise typer.Exit(130) from None
    except Exception as e:
        if out_of_memory(e):
            cpu = type(e).__name__ != "OutOfMemoryError"  # the CPU allocator's "can't allocate"
            hint = "lower --budget or --chunk-size" + ("" if cpu else ", or use --quantize 4bit")
            typer.echo(f"h2o-chat: error: out of memory ({str(e).splitlines()[0]}); {hint}", err=True)
            raise typer.Exit(3) from None
        raise


class Interrupted(KeyboardInterrupt):
    """Ctrl-C once a measurement's finished records were kept; says how many ("2 of 8 windows done")."""


class Finished:
    """A long measurement's records as they finish (`add`, the measurement's callback). With `json_out` each is
    written to stdout at once, one JSON line (`dump`), flushed: Ctrl-C loses none of them. Inside `kept(show)`,
    Ctrl-C shows the records done so far (`show(records, note)`: the table, then `note` under it on stdout, e.g.
    "interrupted: 1 of 4 windows done", marking it partial; not with `json_out`, whose lines are out already) and
    ends as `reported` says: exit 130, one line. `counted(record)`: whether a record is one of the `total` units
    (default: all)."""

    def __init__(
        self,
        json_out: bool,
        total: int,
        unit: str,
        dump: Callable[[typing.Any], str] | None = None,
        counted: Callable[[typing.Any], bool] | None = None,
    ):
        import json

        self.json_out, self.total, self.unit = json_out, total, unit
        self.dump = dump or (lambda record: json.dumps(record, ensure_ascii=False))
        self.counted = counted or (lambda record: True)
        self.records: list = []

    def add(self, record) -> None:
        self.records.append(record)
        if self.json_out:
            typer.echo(self.dump(record))  # click flushes each line

    @property
    def note(self) -> str:
        done = sum(1 for r in self.records if self.counted(r))
        return f"interrupted: {done} of {self.total} {self.unit} done"

    @contextlib.contextmanager
    def kept(self, show: Callable[[list, str], None] | None = None) -> Iterator[Finished]:
        try:
            yield self
        except KeyboardInterrupt:
            note = self.note
            if self.records and not self.json_out and show is not None:
                show(self.records, note)
                typer.echo(note)  # under the table: what it shows is partial
            raise Interrupted(note.removeprefix("interrupted: ")) from None


@contextlib.contextmanager
def summarised(emit: Callable[[list, str], None]) -> Iterator[None]:
    """Ctrl-C in a measurement whose records summarise all its units, once some units are finished: the interrupt
    carries their summaries (`records`) and `note` ("interrupted: 2 of 30 conversations done"; see
    `evaluate.Stopped`), which are written as a finished run's records would be (`emit(records, note)`), and the
    command ends as `reported` says: exit 130, one line."""
    try:
        yield
    except KeyboardInterrupt as e:
        records, note = getattr(e, "records", None), getattr(e, "note", None)
        if not records or not note:
            raise
        emit(records, note)
        raise Interrupted(note.removeprefix("interrupted: ")) from None


class _Fd(io.RawIOBase):
    """A file descriptor whose write errors are named StdoutError (EPIPE apart, which ends quietly as before).
    `refused`: why every write fails (stdout was closed), until `stdout_failed` lets writes go to the null device."""

    def __init__(self, fd: int, refused: str | None = None):
        self.fd, self.refused = fd, refused

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data) -> int:
        if self.refused:
            raise StdoutError(errno.EBADF, self.refused)
        try:
            return os.write(self.fd, data)
        except (BrokenPipeError, BlockingIOError):
            raise
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None


def guard_stdout() -> None:
    """Make a failed write to stdout, wherever it comes from (streamed text, a table, --help), a StdoutError:
    sys.stdout becomes the same text stream over the same descriptor, whose errors say they are stdout's."""
    if sys.stdout is None:  # `h2o-chat ... >&-`: Python gives no stream for a closed descriptor
        _closed_stdout()
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test runner's capture): nothing to guard
    old = sys.stdout
    old.flush()
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(_Fd(fd)), encoding=old.encoding, errors=old.errors, line_buffering=old.line_buffering
    )


def _closed_stdout() -> None:
    """A closed stdout: the null device takes its descriptor, so that no file opened later (a model, -o FILE)
    takes it and receives what a library prints; writing to sys.stdout fails, as a StdoutError."""
    fd = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: 1, unless stdin is closed too
    if fd != 1:
        os.dup2(fd, 1)
        os.close(fd)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_Fd(1, refused="it is closed")), encoding="utf-8")


def require_stdout() -> None:
    """For a command whose results go to stdout, before it loads anything: a closed stdout is one line now, not
    after the work."""
    raw = getattr(getattr(sys.stdout, "buffer", None), "raw", None)
    if isinstance(raw, _Fd) and raw.refused:
        raise StdoutError(errno.EBADF, raw.refused)


def stdout_failed(error: OSError) -> typing.NoReturn:
    """One line for a failed write to stdout, exit 1. Stdout then points to the null device: what is still
    buffered would fail again at the interpreter's exit, and be printed as an ignored exception."""
    typer.echo(f"h2o-chat: cannot write to stdout: {error.strerror or error}", err=True)
    raw = getattr(getattr(sys.stdout, "buffer", None), "raw", None)
    if isinstance(raw, _Fd):
        raw.refused = None  # a closed stdout's descriptor is the null device already
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    raise SystemExit(1)


def status(message: str) -> None:
    typer.echo(f"h2o-chat: {message}", err=True)
