"""Batch's output file: checked before anything loads, read for the ids a rerun skips, only ever appended to;
or stdout, for `-o -` (nothing to resume there).

A file is batch's own when every line is a record batch wrote (a JSON object that starts `{"id": ` and has
"text" and "finish_reason"); any other file is refused untouched. The one repair is a killed run's last line:
whole but for its newline, it gets the newline; cut short, it is moved aside to `<file>.partial` (the file keeps
its complete lines, the row runs again). No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from h2o_chat.errors import InputError

RECORD_START = b'{"id": '  # how every line batch writes begins (json.dumps of a record whose first key is "id")
RECORD_KEYS = {"id", "text", "finish_reason"}
MAX_LINE = 256 * 2**20  # a longer line is no record of ours (and reading it whole would cost as much memory)


def is_stdout(output: Path) -> bool:
    """`-o -`: results on stdout, as Unix tools read `-`."""
    return str(output) == "-"


def check_output(output: Path, input_path: Path) -> None:
    """-o, before anything loads: a regular file, or a new one in an existing folder; never the input. A device
    or a pipe is refused, as /load refuses one: resuming reads the output to its end, and /dev/full has none
    (`-o -` is the way to stdout, whatever it is)."""
    if is_stdout(output):
        return
    if not _existing(output):
        if not output.parent.is_dir():
            raise InputError(f"output folder does not exist: {output.parent}")
        return
    if output.samefile(input_path):  # a symlink or a hard link of it too
        raise InputError(f"-o {output} is the input file: results would be appended to the prompts")


def _existing(output: Path) -> bool:
    """Whether -o names an existing regular file (False: none yet); anything else there is refused."""
    try:
        st = output.stat()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise InputError(f"cannot use -o {output}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"-o {output} is a folder: give a file name, e.g. -o {output / 'results.jsonl'}")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(
            f"-o {output} is not a regular file (a device, a pipe or a socket): give a file name, or -o - for stdout"
        )
    return True


def _not_ours(out: Path, why: str) -> InputError:
    return InputError(
        f"-o {out} is not batch's output ({why}); it is left as it is: give a new file name, or the file of an "
        "earlier run to resume it"
    )


def _parsed(line: bytes):
    """The JSON value on `line`, or None when it holds none (not UTF-8, not JSON, or cut short)."""
    try:
        return json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def _record_id(line: bytes) -> str | int | None:
    """The id of a record batch wrote (a string or an integer, as its input line gave it), or None when `line` is
    not one."""
    record = _parsed(line) if line.startswith(RECORD_START) else None
    if not isinstance(record, dict) or not record.keys() >= RECORD_KEYS:
        return None
    ok = isinstance(record["id"], (str, int)) and not isinstance(record["id"], bool)
    return record["id"] if ok and isinstance(record["text"], str) else None


def finished_ids(out: Path, note: Callable[[str], None] | None = None) -> set[str | int]:
    """The ids already in `out` (none when it does not exist yet). A file that is not batch's own is refused
    (InputError) and left untouched; a killed run's last line is completed or set aside, and `note` told which."""
    if is_stdout(out) or not _existing(out):  # a regular file: a device would never end
        return set()
    ids: set[str | int] = set()
    with out.open("rb") as f:
        number, end = 0, 0  # lines read, and the offset after the last complete one
        while line := f.readline(MAX_LINE):
            number += 1
            if not line.endswith(b"\n"):
                if len(line) == MAX_LINE and f.read(1):
                    raise _not_ours(out, f"line {number} is over {MAX_LINE // 2**20} MB")
                _last_line(out, line, end, number, ids, note)
                break
            record_id = _record_id(line[:-1])
            if record_id is None:
                raise _not_ours(out, f"line {number} is not a record batch wrote")
            ids.add(record_id)
            end = f.tell()
    return ids


def _last_line(out: Path, line: bytes, end: int, number: int, ids: set[str | int], note) -> None:
    """A last line without its newline: a whole record gets its newline (appended); a record cut short (only a
    killed run writes one) is moved aside, with the file cut back to its complete lines; anything else is refused."""
    say = note or (lambda message: None)
    record_id = _record_id(line)
    if record_id is not None:
        with out.open("ab") as f:
            f.write(b"\n")
        ids.add(record_id)
        say(f"{out.name}: its last line lacked its newline (a killed run's); added it")
        return
    torn = line.startswith(RECORD_START) or RECORD_START.startswith(line)
    if not torn or _parsed(line) is not None:  # whole JSON that is not a record: someone else's line
        raise _not_ours(out, f"line {number} is not a record batch wrote")
    aside = _free_name(out)
    with aside.open("xb") as f:  # never over an existing file
        f.write(line)
        f.flush()
        os.fsync(f.fileno())  # the bytes are safe elsewhere before they leave the output
    os.truncate(out, end)
    say(
        f"{out.name} ended in a partial line ({len(line):,} bytes, a killed run's): moved to {aside.name}; "
        "its row runs again"
    )


def _free_name(out: Path) -> Path:
    """`<out>.partial`, or `<out>.partial.2`, ... when an earlier one is kept."""
    aside, n = out.with_name(out.name + ".partial"), 1
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = out.with_name(f"{out.name}.partial.{n}")
    return aside


@contextlib.contextmanager
def appending(output: Path) -> Iterator[TextIO]:
    """Where result lines go: stdout for `-o -` (left open), else the file, opened to append."""
    if is_stdout(output):
        yield sys.stdout
        return
    try:
        f = output.open("a", encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write {output}: {e.strerror}") from None
    with f:
        yield f
