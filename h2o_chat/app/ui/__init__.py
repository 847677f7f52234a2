"""Rendering only: the live stats panel, streamed text, summaries, progress and tables. It is handed records and
prints them; nothing here decides anything about generation (the chat loop and the CLI call in with what to show).

`text`: words and numbers as the user reads them, and the console; `progress`: bars and lines for long work;
`live`: the chat's panel and streamed reply; `tables`: the measuring commands' tables. Their names are here.
"""

from h2o_chat.app.ui.live import PANEL_FRAME, PanelView, StreamView, TurnStats
from h2o_chat.app.ui.progress import LOG_EVERY, ProgressBar, progress_bar
from h2o_chat.app.ui.tables import (
    bench_table,
    eviction_table,
    models_tables,
    prefill_table,
    rich_table,
    soak_table,
    throughput_table,
)
from h2o_chat.app.ui.text import (
    COMPACT_BELOW,
    NOT_TIMED,
    describe_device,
    describe_kv,
    describe_machine,
    describe_policy,
    describe_store,
    describe_weights,
    duration,
    fit,
    human_bytes,
    make_console,
    plural,
    quote,
    reading_label,
    share,
    summary_line,
    wrap,
)

__all__ = [
    "COMPACT_BELOW", "LOG_EVERY", "NOT_TIMED", "PANEL_FRAME", "PanelView", "ProgressBar", "StreamView", "TurnStats",
    "bench_table", "describe_device", "describe_kv", "describe_machine", "describe_policy", "describe_store",
    "describe_weights",
    "duration", "eviction_table", "fit", "human_bytes", "make_console", "models_tables", "plural", "prefill_table",
    "progress_bar", "quote", "reading_label", "rich_table", "share", "soak_table", "summary_line",
    "throughput_table", "wrap",
]  # fmt: skip
