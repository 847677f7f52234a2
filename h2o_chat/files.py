"""Where h2o-chat keeps its files, and how a user's file is read: shared by every layer, imports nothing else.

No torch here. Folders follow the XDG variables; `H2O_CHAT_CACHE` moves the cache (converted weights, random
models of real shapes, compiled kernels). A read-only home does not stop the tool: the cache falls back to a
private temporary folder, with one note.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from h2o_chat.errors import H2OChatError, InputError

BUILDING = ".building-"  # beside the compiled steps: a package being built, named by its key
BUILDING_STALE = 15 * 60  # seconds: a build's marker older than this belongs to a build that died


def cxx_name() -> str:
    """The C++ compiler h2o-chat's builds use: `$CXX`, else g++, the one inductor uses for the compiled steps (so
    the kernel and the steps are built alike)."""
    return os.environ.get("CXX", "g++")


def cxx() -> str | None:
    """`cxx_name()` found on the PATH, or None."""
    return shutil.which(cxx_name())


def claim_build(marker: Path) -> bool:
    """Whether this process may start the build `marker` names: no other process is building that package (its
    marker is absent, or stale). The builder removes it when done."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        try:
            if time.time() - marker.stat().st_mtime < BUILDING_STALE:
                return False
        except FileNotFoundError:  # it has just finished
            return False
        marker.touch()
        return True


def start_build(args: list[str], log: Path) -> None:
    """`python -m ARGS` in a process of its own (a build beside a program that goes on): niced, in its own session,
    its output appended to `log`."""
    with open(log, "a") as out:  # the child keeps its own handle
        subprocess.Popen(
            [sys.executable, "-m", *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=lambda: os.nice(10),
        )  # fmt: skip


def cpu_info(field: str) -> str | None:
    """A field of the first processor in /proc/cpuinfo ("model name", "flags"); None where there is none (not
    Linux, no such field)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def user_config_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "h2o-chat"


def user_data_dir() -> Path:
    """Where the input history lives."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "h2o-chat"


def user_cache_dir() -> Path:
    """Where converted weights live; H2O_CHAT_CACHE overrides."""
    if os.environ.get("H2O_CHAT_CACHE"):
        return Path(os.environ["H2O_CHAT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "h2o-chat"


def unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (made if missing), or None when they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def kept_in() -> str:
    """Where converted weights go, as `models` says it: the user cache folder, or the temporary one a folder that
    cannot be written gives way to (`writable_cache_dir`), with why."""
    wanted = user_cache_dir()
    why = unwritable(wanted)
    if why is None:
        return str(wanted)
    return f"{writable_cache_dir()} ({wanted} cannot be written: {why})"


_fallback: dict[Path, Path] = {}


def writable_cache_dir(note: Callable[[str], None] | None = None) -> Path:
    """The user cache folder, or, when it cannot be written (a read-only home), a private temporary folder for
    this user; `note` is told once which, and why. A tool that cannot cache should still run."""
    wanted = user_cache_dir()
    if wanted in _fallback:
        return _fallback[wanted]
    why = unwritable(wanted)
    if why is None:
        return wanted
    folder = Path(tempfile.gettempdir()) / f"h2o-chat-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        private = folder.is_dir() and not folder.is_symlink() and st.st_mode & 0o077 == 0
        if not private or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise PermissionError  # someone else's folder in a shared /tmp: use a fresh one
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="h2o-chat-"))
    _fallback[wanted] = folder
    if note:
        note(
            f"note: cannot write {wanted} ({why}); converted weights are cached in {folder} instead "
            "(set H2O_CHAT_CACHE to a writable folder to keep them)"
        )
    return folder


MAX_FILE_BYTES = 64 * 2**20  # a conversation or a models.toml; batch input files may be larger (see batch.py)
_READ_CHUNK = 2**20  # read in pieces: Ctrl-C is honoured between them


def read_user_bytes(
    path: Path,
    what: str = "file",
    error: type[H2OChatError] = InputError,
    limit: int = MAX_FILE_BYTES,
    streams: bool = False,
) -> bytes:
    """A user's regular file of at most `limit` bytes, or one clear error saying what is wrong with it. Devices
    (/dev/zero), pipes and folders are refused before they are opened: reading one could block, or never end.
    `streams`: what a user may pipe in is read too, to its end or to `limit` -- a pipe, a terminal, `<(...)`,
    /dev/stdin, and `-` for standard input (a prompt, as `cat` reads one)."""
    if streams and str(path) == "-":
        return _read_limited(sys.stdin.buffer, "standard input (-)", what, error, limit)
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} {path} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode) and not streams:
        raise error(f"{what} {path} is not a regular file (a device, a pipe or a socket)")
    if st.st_size > limit:
        raise error(f"{what} {path} is {_size(st.st_size)}; h2o-chat reads at most {_size(limit)}")
    try:
        with path.open("rb") as f:
            return _read_limited(f, path, what, error, limit)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None


def _read_limited(f, name, what: str, error: type[H2OChatError], limit: int) -> bytes:
    """`f` to its end in pieces (Ctrl-C is honoured between them), or an error once it passes `limit` bytes (a
    file that grew while being read, a stream that never ends)."""
    pieces, total = [], 0
    try:
        while piece := f.read(_READ_CHUNK):
            total += len(piece)
            if total > limit:
                raise error(f"{what} {name} is over {_size(limit)}; h2o-chat reads at most that")
            pieces.append(piece)
    except OSError as e:
        raise error(f"cannot read {what} {name}: {e.strerror}") from None
    return b"".join(pieces)


def read_user_text(
    path: Path,
    what: str = "file",
    error: type[H2OChatError] = InputError,
    limit: int = MAX_FILE_BYTES,
    streams: bool = False,
) -> str:
    """A user's UTF-8 file (see read_user_bytes), or one clear error saying what is wrong with it."""
    data = read_user_bytes(path, what, error, limit, streams)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"cannot read {what} {path}: not UTF-8 text (byte offset {e.start})") from None


def _size(n: int) -> str:
    return f"{n / 2**20:,.0f} MB" if n >= 2**20 else f"{n:,} bytes"
