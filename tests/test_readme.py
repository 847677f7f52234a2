"""The library example (docs/library.md, linked from the README) runs as written (on a tiny local model instead
of a hub download)."""

from __future__ import annotations

import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "docs" / "library.md"


def library_example() -> str:
    section = LIBRARY.read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_library_example_runs_as_written(tiny_folder, capsys):
    code = library_example()
    name_line = next(line for line in code.splitlines() if line.startswith("name = "))
    code = code.replace(name_line, f"name = {str(tiny_folder)!r}")  # the one line that differs: no hub here
    exec(compile(code, "library.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    stats = next(line for line in printed if line.startswith("CacheStats("))
    seen, kept, evicted = (float(re.search(rf"\b{k}=([\d.]+)", stats).group(1)) for k in ("seen", "kept", "evicted"))
    assert kept == 64 and seen > 64 and evicted == seen - 64  # it generated past the budget and evicted
    assert len(printed) == 3 and printed[-1].strip()  # the engine's continuation was printed too
