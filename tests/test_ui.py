"""Rendering only: the tables and panels, drawn onto consoles of chosen widths."""

from __future__ import annotations

import io

from rich.console import Console

from h2o_chat.app import ui
from h2o_chat.measure.bench import BenchRecord, ratios


def draw(renderable, width: int = 120, **kwargs) -> str:
    console = Console(file=io.StringIO(), width=width, no_color=True, **kwargs)
    console.print(renderable)
    return console.file.getvalue()


def test_bench_table_prints_measured_ratios_without_targets():
    records = [
        BenchRecord(config, "h2o" if config.startswith("h2o") else "full", 32, seen, ms, kv, measured_at=at)
        for config, seen, at, ms, kv in [
            ("dynamic", 40, 40, 10.0, 100),
            ("dynamic", 80, 80, 12.0, 200),
            ("h2o", 40, 40, 11.0, 50),
            ("h2o", 80, 80, 11.5, 50),
            ("h2o@first", 40, 80, 11.0, 50),
        ]
    ]
    out = draw(ui.bench_table(records, ratios(records, 32)))
    assert "h2o 32 / dynamic: ms/token at 80 seen" in out and "0.96x" in out  # 11.5 / 12.0
    assert "target" not in out and "NOT met" not in out and " met" not in out


def stats(seen: int = 415, kept: float = 64.0, evicted: float = 351.0, **kwargs):
    from h2o_chat.engine.slots import CacheStats

    return CacheStats(
        "snap", 64, {"heavy": 32, "recent": 32}, 30, seen, kept, 64, 64, evicted,
        kv_bytes=2_949_120, kv_used_bytes=2_949_120, full_kv_bytes=19_123_200,
        positions="auto: absolute, trained context 8192", **kwargs,
    )  # fmt: skip


def test_panel_is_two_plain_lines_on_a_narrow_terminal_and_a_box_on_a_wide_one():
    view = ui.PanelView("smollm2-135m", "cpu, float32")
    narrow = draw(view.render(stats()), width=40).splitlines()
    assert len(narrow) == 2 and all(len(line) <= 40 for line in narrow), narrow
    assert "╭" not in "".join(narrow) and narrow[0].startswith("snap 64 | 415 seen, 64 kept")
    assert "KV 2.8 MB alloc, 2.8 MB used" in narrow[1]
    wide = draw(view.render(stats()), width=120).splitlines()
    assert wide[0].startswith("╭─ h2o-chat") and len(wide) == 10 and all(len(line) == 120 for line in wide)
    for label in ("model", "policy", "tokens", "positions", "evicted", "KV cache", "memory", "speed"):
        assert any(line.startswith(f"│ {label}") for line in wide), label
    # the height never changes with the figures: a live area that grows leaves lines in the scrollback
    for width in (80, 100, 120):
        heights = {len(draw(view.render(s), width=width).splitlines()) for s in (stats(), stats(10**7, 1e6, 1e7))}
        assert heights == {10}, (width, heights)


def test_no_color_gets_a_plain_summary_instead_of_the_box():
    view = ui.PanelView("smollm2-135m", "cpu, float32", plain=True)
    out = draw(view.render(stats()), width=120).splitlines()
    assert len(out) == 2 and not any(c in "".join(out) for c in "╭│╰")
    assert "snap 64 (32 heavy + 32 recent) | 415 seen, 64 kept" in out[0]


def test_toolbar_fits_the_terminal(embedded, tmp_path):
    from test_chat import session

    chat = session(embedded, tmp_path)
    for width in (40, 60, 80, 100, 120, 200):
        bar = chat.toolbar(width)
        assert len(bar) < width and bar.endswith("| /help"), (width, bar)
    assert "in use" in chat.toolbar(200) and chat.toolbar(40).startswith(" h2o 64 | 0 seen")
