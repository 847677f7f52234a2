"""Rendering only: the tables and panels, drawn onto consoles of chosen widths."""

from __future__ import annotations

import io

from rich.console import Console

from h2o_chat.app import ui
from h2o_chat.app.ui import progress as ui_progress
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


def test_bench_ratios_against_llama_cpp_for_the_eager_and_the_compiled_step():
    records = [
        BenchRecord(config, "full" if config == "llama.cpp" else "h2o", 32, seen, ms, 50, measured_at=seen)
        for config, seen, ms in [
            ("llama.cpp", 40, 10.0),
            ("llama.cpp", 80, 20.0),
            ("h2o", 40, 16.0),
            ("h2o", 80, 16.5),
            ("h2o-compiled", 40, 8.0),
            ("h2o-compiled", 80, 8.5),
        ]
    ]
    got = dict(ratios(records, 32))
    assert got["h2o 32 / llama.cpp: ms/token at 80 seen"] == 16.5 / 20.0
    assert got["h2o-compiled 32 / llama.cpp: ms/token at 40 seen"] == 8.0 / 10.0
    assert got["h2o-compiled 32 / llama.cpp: ms/token at 80 seen"] == 8.5 / 20.0


def stats(seen: int = 415, kept: float = 64.0, evicted: float = 351.0, **kwargs):
    from h2o_chat.engine.stats import CacheStats

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


def test_the_progress_bar_fits_a_narrow_terminal_without_cutting_words():
    """Issue 22.12: at 40 columns the bar gives way and the description wraps at word boundaries."""
    description = "reading the conversation (12 messages) (twice: snap)"
    for width in (40, 60, 100):
        console = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=True)
        progress = ui_progress.progress_display(console)
        progress.update(progress.add_task(description, total=8720), completed=4360)
        lines = draw(progress.get_renderable(), width=width).splitlines()
        assert all(len(line) <= width for line in lines), (width, lines)
        assert set(description.split()) <= set(" ".join(lines).split()), (width, lines)  # every word whole
        assert "4360/8720" in lines[0]


def test_the_panel_shows_the_memory_it_is_handed():
    """Issue 18: the one process-memory reader lives in models/memory.py; the panel draws what it is given."""
    view = ui.PanelView("tiny", "cpu, float32", memory=lambda: {"rss": 123 * 2**20})
    assert "RSS 123.0 MB" in draw(view.render(stats()), width=120)


def test_summary_leaves_a_one_time_setup_out_of_tok_s():
    """Issue 22.11: a capture or compilation is said apart, not folded into the decode speed."""
    from types import SimpleNamespace

    record = SimpleNamespace(generation_tokens=11, prompt_tokens=1, prompt_tps=5.0, generation_tps=0.1)
    line = ui.summary_line(record, stats(), "CUDA graph (1 captured, 1.2 s)", (50.0, 20.0, 1.2))
    assert line.startswith(
        "11 tokens, 20.0 tok/s, CUDA graph (1 captured, 1.2 s) (prompt 1 token, 50 tok/s; one-time setup 1.2 s"
    )
    weighed = ui.summary_line(record, stats(), "eager", (50.0, 20.0, 0.0), "int4 groups of 32, 141.1 MB")
    assert weighed.endswith(" | weights int4 groups of 32, 141.1 MB")


def test_the_device_line_says_the_weights_format_and_bytes():
    from types import SimpleNamespace

    import torch

    loaded = SimpleNamespace(
        device=torch.device("cpu"), dtype=torch.float32, quantize="4bit", weights="int4 groups of 32",
        weight_bytes=141 * 2**20,
    )  # fmt: skip
    assert ui.describe_device(loaded) == "cpu, int4 groups of 32, 141.0 MB, float32 compute"


def test_the_reading_bar_says_which_part_snap_reads_twice():
    """snap's probe reads a prompt that overflows the budget, then the prompt is read again."""
    assert ui.reading_label(100, 100) == "reading the prompt"
    assert ui.reading_label(200, 100) == "reading the prompt (twice: snap)"
    assert ui.reading_label(50, 0) == "reading the prompt"


def test_a_measurement_logged_to_a_file_says_how_far_it_is_and_how_long_is_left(monkeypatch):
    """Not a terminal: no bar, but a plain line at most once per `every` seconds (an hour-long eval into a log must
    not look hung); the share and the time left follow from the steps done so far."""
    clock = [100.0]
    monkeypatch.setattr(ui_progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    bar = ui.ProgressBar(Console(file=out, force_terminal=False), "ppl, 3 rows", every=60)
    for done, now in ((10, 130.0), (20, 160.0), (30, 190.0), (50, 250.0), (100, 400.0)):
        clock[0] = now
        bar(done, 100)
    lines = out.getvalue().splitlines()
    # 60 s after the start (done 20 of 100: 60 s for 20, so 240 s left), then not before 60 s more (done 50)
    assert lines == [
        "h2o-chat: ppl, 3 rows: 20/100 (20%), about 4 min left",
        "h2o-chat: ppl, 3 rows: 50/100 (50%), about 2 min left",
    ]
    quiet = io.StringIO()
    silent = ui.ProgressBar(Console(file=quiet, force_terminal=False), "reading")  # piped text: no lines
    silent(50, 100)
    assert quiet.getvalue() == ""


def test_the_panel_shows_the_reading_speed_while_a_message_is_read_not_zeros():
    """Issue 38.11: before the first token the turn has no prefill or decode speed: the reading speed so far."""
    view = ui.PanelView("smollm2-135m", "cpu, float32")
    for width in (40, 120):
        assert "0 tok/s" not in draw(view.render(stats()), width=width)
    view.turn.reading_tps = 812.4
    assert "reading 812 tok/s so far" in draw(view.render(stats()), width=120)
    assert "reading 812 tok/s" in view.lines(stats(), {"rss": 0}, 120)[-1]  # the two-line summary too
    view.turn.reading_tps = 0.0
    view.turn.prompt_tps, view.turn.generation_tps = 900.0, 31.25
    assert "prefill 900 tok/s, decode 31.2 tok/s" in draw(view.render(stats()), width=120)


def test_the_kv_and_evicted_rows_fit_80_to_220_columns_with_recall():
    """Issue 38.6: at 120 columns with -p recall the KV row was cut ('...evicted tokens kept for'). Every row
    fits whole from 80 to 220 columns, the recall store on the evicted row."""
    view = ui.PanelView("smollm2-135m", "cpu, float32")
    big = stats(10**6, 1e5, 9e5, store_bytes=123_456_789)
    big = type(big)(**{**big.__dict__, "kv_bytes": 1023 * 2**20, "kv_used_bytes": 1000 * 2**20})
    for s in (stats(store_bytes=30_720), big):
        for width in (80, 120, 220):
            lines = draw(view.render(s), width=width).splitlines()
            assert len(lines) == 10 and not any("…" in line for line in lines), (width, lines)
            text = " ".join(lines)
            assert f"{ui.human_bytes(s.store_bytes)} kept for recall" in text
            assert "full" in text and "alloc" in text
    wide = " ".join(draw(view.render(stats()), width=220).split())
    assert "a full cache would hold 18.2 MB (15% allocated)" in wide  # the whole wording where it fits


def test_the_panel_at_80_columns_never_cuts_a_word():
    """Issue 48.13: at 80 columns the panel cut the model row inside a word ("int8 embedd…"). A row too long for
    the width drops whole clauses (then whole words), marked with "…"."""
    device = "cpu, int4 groups of 32 (LM head too), int8 embedding, 158.0 MB, float32 compute"
    view = ui.PanelView("smollm2-135m", device)
    view.turn = ui.TurnStats(prompt_tps=250.0, generation_tps=31.25, decode="compiled step (1 compilation, 45.0 s)")
    for width in (80, 90, 100):
        lines = draw(view.render(stats()), width=width).splitlines()
        assert len(lines) == 10 and all(len(line) == width for line in lines)
        rows = {label: value for label, value in view.entries(stats(), {"rss": 0}, width)}
        for label, full in (("model", f"smollm2-135m on {device}"), ("speed", view.turn.speed())):
            line = next(line for line in lines if line.startswith(f"│ {label}"))
            shown = line.strip("│ ").removeprefix(label).strip()
            assert shown == rows[label] and len(shown) <= width - ui.PANEL_FRAME, (width, shown)
            if shown != full:  # cut: at a word's end, marked
                assert shown.endswith(" …") and full.startswith(shown[:-2]), (width, shown)
                assert full[len(shown) - 2] in " ,;(", (width, shown)
    assert ui.fit("smollm2-135m on cpu, int4 groups of 32 (LM head too), int8 embedding", 40) == (
        "smollm2-135m on cpu, int4 groups of 32 …"
    )
    assert ui.fit("supercalifragilistic", 10) == "supercali…"  # one word longer than the width: nothing better
