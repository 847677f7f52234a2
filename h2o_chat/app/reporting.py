"""How a command ends when something goes wrong: the errors users can cause as one line on stderr and a
non-zero exit (`reported`), a failed or closed stdout as one line too (`guard_stdout`, `require_stdout`,
`stdout_failed`), and the status lines every command prints (`status`)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import typing
from collections.abc import Iterator

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
    except KeyboardInterrupt:
        typer.echo("h2o-chat: interrupted", err=True)
        raise typer.Exit(130) from None
    except Exception as e:
        if out_of_memory(e):
            cpu = type(e).__name__ != "OutOfMemoryError"  # the CPU allocator's "can't allocate"
            hint = "lower --budget or --chunk-size" + ("" if cpu else ", or use --quantize 4bit")
            typer.echo(f"h2o-chat: error: out of memory ({str(e).splitlines()[0]}); {hint}", err=True)
            raise typer.Exit(3) from None
        raise


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
