"""The tables of the measuring commands (bench, prefill, throughput, soak), the models list and /evicted."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from h2o_chat.app.ui.text import human_bytes, share


def eviction_table(reports) -> Table:
    """/evicted: each message the cache has seen and how much of it is still held."""
    table = Table(box=None, pad_edge=False)
    columns = [("#", "right"), ("role", "left"), ("tokens", "right"), ("kept", "right")]
    recalled = any(r.recalled for r in reports)  # the last turn recalled evicted tokens (recall): from where
    columns += [("recalled", "right")] if recalled else []
    for col, justify in (*columns, ("message", "left")):
        table.add_column(col, justify=justify)
    for r in reports:
        style = "" if r.kept >= 0.999 else ("yellow" if r.kept > 0.5 else "red")
        back = [f"{100 * r.recalled:.0f}%" if r.recalled else ""] if recalled else []
        table.add_row(str(r.index), r.role, str(r.tokens), share(r.kept), *back, r.preview, style=style)
    return table


def models_tables(rows: list[tuple[str, ...]], caption: str, width: int) -> list[Table]:
    """`h2o-chat models`: rows of (alias, present, family, dtype/quant, context, source, note). A source (a repo
    id, a path) has no space to wrap at and is never cut: it gets a column as wide as the longest one, beside the
    other columns when `width` allows, else in a second table of its own (alias, source / note)."""
    header = ["alias", "present", "family", "dtype/quant", "context"]
    widths = [max(len(r[i]) for r in [header, *rows]) + 2 for i in range(len(header))]
    longest = max(len(r[5]) for r in rows)
    beside = sum(widths) + longest <= width
    tables = [Table(box=None, pad_edge=False)]
    for col in header:
        tables[0].add_column(col, no_wrap=True)
    if not beside:
        tables.append(Table(box=None, pad_edge=False))
        tables[1].add_column("alias", no_wrap=True)
    tables[-1].add_column("source / note", min_width=longest)
    for row in rows:
        source = Text(f"{row[5]}\n{row[6]}", overflow="fold")
        if beside:
            tables[0].add_row(*row[:5], source)
        else:
            tables[0].add_row(*row[:5])
            tables[1].add_row(row[0], source)
    tables[-1].caption = caption
    return tables


def bench_table(records, ratios, about: str = "") -> Group:
    """Decode speed and KV memory per configuration and length, then the measured ratios (only what was
    measured: a target beside each read like a failed run to users). `about`: the model, weights, threads."""
    configs = list(dict.fromkeys(r.config for r in records if r.config != "h2o@first"))
    title = "decode ms/token (median) | KV cache" + (f" ({about})" if about else "")
    table = Table(title=title, title_justify="left")
    table.add_column("seen", justify="right")
    for c in configs:
        first = next(r for r in records if r.config == c)
        label = c if first.budget is None or c == "h2o-nobound" else f"{c} {first.budget}"
        table.add_column(f"{label} ({first.decode})", justify="right")
    for length in sorted({r.measured_at for r in records}):
        row = [str(length)]
        for c in configs:
            rec = next((r for r in records if r.config == c and r.measured_at == length), None)
            row.append(f"{rec.ms_per_token:.2f} | {human_bytes(rec.kv_bytes)}" if rec else "")
        table.add_row(*row)
    # the h2o twin parked at the first length, timed in the last length's rounds beside the others: the flatness
    # ratio divides by it, so it is shown (a ratio over a figure the table hid contradicted the table)
    twin = max((r for r in records if r.config == "h2o@first"), key=lambda r: r.measured_at, default=None)
    if twin is not None and "h2o" in configs and twin.measured_at != twin.seen:
        cells = [f"{twin.ms_per_token:.2f} | {human_bytes(twin.kv_bytes)}" if c == "h2o" else "" for c in configs]
        table.add_row(f"{twin.seen} (twin)", *cells)
    setup = [f"{c} {r.setup_seconds:.1f} s" for c in configs for r in [next(x for x in records if x.config == c)]]
    setup = [s for s, c in zip(setup, configs, strict=True) if next(x for x in records if x.config == c).setup_seconds]
    caption = [f"one-time capture or compilation: {', '.join(setup)}"] if setup else []
    if twin is not None and "h2o" in configs and twin.measured_at != twin.seen:
        caption.append(f"twin: a second h2o cache kept at {twin.seen} seen, timed in the rounds of {twin.measured_at}")
    if caption:
        table.caption = "; ".join(caption)
    lines = Table(box=None, show_header=False)
    for text, value in ratios:
        lines.add_row(text, f"{value:.2f}x")
    return Group(table, lines)


def prefill_table(records, ratios, model: str) -> Group:
    """Reading one prompt: seconds, tokens/s, extra peak memory and operators per layer and chunk per row, then
    the ratios measured in the same run."""
    first = records[0]
    title = f"reading a {first.batch} x {first.prompt_tokens}-token prompt ({model}, {first.device}, {first.dtype})"
    table = Table(title=title, title_justify="left")
    for col in ("reader", "chunk", "seconds", "tokens/s", "extra peak", "ops/layer/chunk"):
        table.add_column(col, justify="left" if col == "reader" else "right")
    for r in records:
        label = r.config if r.budget is None else f"{r.config} {r.budget}"
        ops = f"{r.ops_per_layer:.0f}" if r.ops_per_layer else ""
        chunk = str(r.chunk) if r.chunk else "one pass"
        table.add_row(
            label, chunk, f"{r.seconds:.3f}", f"{r.tokens_per_second:,.0f}", human_bytes(r.extra_peak_bytes), ops
        )
    lines = Table(box=None, show_header=False)
    for text, value in ratios:
        lines.add_row(text, f"{value:.2f}x")
    return Group(table, lines)


def throughput_table(records, model: str) -> Table:
    """Tokens/s at the largest batch that fits the memory limit, full cache vs h2o."""
    limit = human_bytes(records[0].memory_limit) if records else "?"
    table = Table(title=f"generation throughput at {limit} ({model})", title_justify="left")
    for col in ("cache", "batch", "prompt+gen", "tokens/s", "KV", "peak memory"):
        table.add_column(col, justify="left" if col == "cache" else "right")
    for r in records:
        label = "full" if r.config == "full" else f"h2o {r.budget}"
        table.add_row(
            label,
            str(r.batch),
            f"{r.prompt_tokens}+{r.generated_tokens}",
            f"{r.tokens_per_second:.1f}",
            human_bytes(r.kv_bytes),
            human_bytes(r.peak_bytes),
        )
    full = next((r for r in records if r.config == "full"), None)
    h2o = next((r for r in records if r.config == "h2o"), None)
    if full and h2o and full.tokens_per_second:
        table.caption = (
            f"h2o / full throughput: {h2o.tokens_per_second / full.tokens_per_second:.2f}x "
            f"(both decoded by the same engine: {h2o.decode})"
        )
    return table


def rich_table(table) -> Table:
    """A measurement's (title, header, rows) table, drawn for the terminal."""
    title, header, rows = table
    out = Table(title=title, title_justify="left")
    for i, col in enumerate(header):
        out.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


def soak_table(records, model: str, policy: str, flatness: dict[str, float]) -> Group:
    """Per window (`policy`, e.g. "h2o 256"): tokens seen, process memory, perplexity per configuration; then memory
    flatness (max / min after the first window, per memory figure, as the soak measured it)."""
    labels = list(records[0]["ppl"]) if records else []
    table = Table(title=f"soak: {model}, {policy}: perplexity per window", title_justify="left")
    table.add_column("tokens", justify="right")
    table.add_column("RSS", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    for r in records:
        table.add_row(
            f"{r['window'][0]}-{r['window'][1]}", human_bytes(r["rss"]), *(f"{r['ppl'][k]:.2f}" for k in labels)
        )
    lines = Table(box=None, show_header=False)
    if len(records) > 1:
        lines.add_row("process memory after the first window: max / min", f"{flatness['rss']:.3f}")
        if "gpu_allocated" in flatness:
            lines.add_row("GPU memory after the first window: max / min", f"{flatness['gpu_allocated']:.3f}")
    return Group(table, lines)
