"""Rendering only: the tables and panels, drawn onto consoles of chosen widths."""

from __future__ import annotations

import io

from rich.console import Console

from h2o_chat import ui
from h2o_chat.bench import BenchRecord, ratios


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
    assert "dynamic / h2o 32: ms/token at 80 seen" in out and "1.04x" in out  # 12.0 / 11.5
    assert "target" not in out and "NOT met" not in out and " met" not in out
