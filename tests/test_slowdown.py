"""A decode pace that collapses on a busy CPU is said once, with what may help (issue 48.14)."""

from __future__ import annotations

from h2o_chat.app.chat import slowdown
from h2o_chat.app.chat.slowdown import WINDOW, SlowdownWatch


def run(watch: SlowdownWatch, monkeypatch, seconds: list[float], setup: float = 0.0) -> list[str]:
    """Steps of the given durations; the notes the watch returned."""
    now = [0.0]
    monkeypatch.setattr(slowdown, "clock", lambda: now[0])
    notes = []
    for dt in seconds:
        now[0] += dt
        if note := watch.step(setup):
            notes.append(note)
    return notes


def test_a_collapse_on_a_busy_machine_is_said_once_with_the_remedy(monkeypatch):
    watch = SlowdownWatch(threads=lambda: 2, load=lambda: 3.5)
    notes = run(watch, monkeypatch, [0.02] * (3 * WINDOW) + [0.8] * (4 * WINDOW))
    assert len(notes) == 1 and notes[0].startswith("decode slowed to 1.2 tok/s from 50.0 earlier")
    assert "load (3.5) above the 2 threads torch uses" in notes[0] and notes[0].endswith("--threads 1 may help")
    assert watch.summary == "decode slowed 40x on a busy CPU: try --threads 1"


def test_no_note_without_a_busy_machine_a_collapse_or_when_a_compilation_took_the_time(monkeypatch):
    quiet = SlowdownWatch(threads=lambda: 2, load=lambda: 1.0)  # slower, but nothing else runs: not this
    assert run(quiet, monkeypatch, [0.02] * (2 * WINDOW) + [0.8] * (2 * WINDOW)) == []
    steady = SlowdownWatch(threads=lambda: 2, load=lambda: 9.0)  # busy, and no slower than 4x
    assert run(steady, monkeypatch, [0.02] * (2 * WINDOW) + [0.06] * (2 * WINDOW)) == []
    compiled = SlowdownWatch(threads=lambda: 2, load=lambda: 9.0)
    run(compiled, monkeypatch, [0.02] * (2 * WINDOW))
    assert run(compiled, monkeypatch, [5.0] + [0.02] * 4, setup=5.0) == []  # the window that paid a compile is reset
    one = SlowdownWatch(threads=lambda: 1, load=lambda: 3.0)  # one thread already: no remedy to offer
    notes = run(one, monkeypatch, [0.02] * (2 * WINDOW) + [0.8] * (2 * WINDOW))
    assert len(notes) == 1 and "--threads" not in notes[0] and "another process is busy" in notes[0]
