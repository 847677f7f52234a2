"""Presenting evaluation records: tables (markdown for docs; the app draws them in the terminal) and figures.

Works on the JSON records of `h2o_chat.measure.evaluate` only (no torch), so results can be re-rendered from files.
A table is (title, header, rows) of strings; `markdown` renders it here, `app.ui.rich_table` on a terminal.
"""

from __future__ import annotations

from collections.abc import Callable
from math import nan
from pathlib import Path

Table = tuple[str, list[str], list[list[str]]]


def _budget_columns(records: list[dict]) -> list[str]:
    """Budget columns in the order given, e.g. ["10%", "20%"] (as typed), skipping the full cache."""
    return list(dict.fromkeys(r["spec"] for r in records if r["budget"] is not None))


def _column_title(records: list[dict], spec: str) -> str:
    """ "10% (158)" for a share of the reference, "256 (12.5%)" for tokens."""
    r = next(r for r in records if r["spec"] == spec)
    return f"{spec} ({r['budget']})" if spec.endswith("%") else f"{spec} ({r['budget_pct']:g}%)"


def _pivot(records: list[dict], cell: Callable[[dict], str]) -> tuple[list[str], list[list[str]]]:
    """Rows = policies, columns = budgets; the full cache's value fills its whole row (no budget applies)."""
    specs = _budget_columns(records)
    header = ["policy", *(_column_title(records, s) for s in specs)]
    rows = []
    for policy in dict.fromkeys(r["policy"] for r in records):
        if policy == "full":
            continue
        cells = {r["spec"]: cell(r) for r in records if r["policy"] == policy}
        rows.append([policy, *(cells.get(s, "") for s in specs)])
    for r in records:
        if r["policy"] == "full":
            rows.append(["full (reference)", *[cell(r)] * len(specs)])
    return header, rows


def ppl_table(records: list[dict]) -> Table:
    n, prompt = records[0]["tokens"], records[0].get("prompt_tokens", 1)
    header, rows = _pivot(records, lambda r: f"{r['ppl']:.2f}")
    scored = f"the last {n - prompt} of {n} tokens after a {prompt}-token prompt" if prompt > 1 else f"{n} tokens"
    return f"perplexity over {scored}, teacher-forced (budget: tokens per layer and head)", header, rows


def agree_table(records: list[dict]) -> Table:
    def cell(r: dict) -> str:  # ROUGE-L, then how long the continuation stayed token-identical (mean)
        prefix = r.get("same_prefix")
        return f"{r['rouge_l']:.3f}" + (f" ({sum(prefix) / len(prefix):.0f})" if prefix else "")

    r0 = records[0]
    header, rows = _pivot(records, cell)
    title = (
        f"ROUGE-L F1 vs the full cache (mean tokens before the first divergence): greedy {r0['tokens']} tokens "
        f"after {r0['prompts']} prompts of <= {r0['prompt_tokens']} tokens"
    )
    return title, header, rows


def _needle_cell(record: dict) -> str:
    """ "2/2", or with a partial score the haystacks that were right: "1/2 (alice)"."""
    cell = f"{record['correct']}/{record['trials']}"
    if 0 < record["correct"] < record["trials"]:
        cell += f" ({', '.join(Path(a['haystack']).stem for a in record['answers'] if a['correct'])})"
    return cell


def needle_table(records: list[dict]) -> Table:
    """Rows = configurations, columns = depths (correct/trials over the haystacks), then the total."""
    depths = list(dict.fromkeys(r["depth"] for r in records))
    configs = list(dict.fromkeys((r["policy"], r["budget"]) for r in records))
    header = ["policy", "budget", *(f"depth {d:g}" for d in depths), "accuracy"]
    rows = []
    for policy, budget in configs:
        mine = [r for r in records if (r["policy"], r["budget"]) == (policy, budget)]
        by_depth = {r["depth"]: _needle_cell(r) for r in mine}
        correct, trials = sum(r["correct"] for r in mine), sum(r["trials"] for r in mine)
        shown = "full" if budget is None else f"{budget} ({mine[0]['budget_pct']:g}%)"
        rows.append([policy, shown, *(by_depth.get(d, "") for d in depths), f"{correct / trials:.0%}"])
    n = records[0]["prompt_tokens"]
    return f"needle retrieval: 4-digit code at each depth of a {n}-token prompt", header, rows


def _recall_cells(r: dict) -> list[str]:
    gain = "" if r["gain_kept"] is None else f"{r['gain_kept']:.2f}"
    if r.get("gain_kept_90") and r["budget"] is not None:
        gain += f" ({r['gain_kept_90'][0]:.2f}-{r['gain_kept_90'][1]:.2f})"
    return [f"{r['hits']}/{r['conversations']}", gain]


def recall_table(records: list[dict]) -> Table:
    """Rows = policies (then the full cache, and the full cache without the fact), columns = per budget: greedy
    hits and the share of the full cache's likelihood gain kept (90% bootstrap interval)."""
    specs = _budget_columns(records)
    header = ["policy"]
    for spec in specs:
        r = next(r for r in records if r["spec"] == spec)
        header += [f"{spec} ({r['budget']}) hits", f"{spec} gain kept"]
    rows = []
    label = lambda r: r["policy"] + (f" (store {r['store']})" if r.get("store") else "")  # noqa: E731
    for name in dict.fromkeys(label(r) for r in records if r["budget"] is not None):
        cells = {r["spec"]: _recall_cells(r) for r in records if label(r) == name and r["budget"] is not None}
        rows.append([name, *(c for s in specs for c in cells.get(s, ["", ""]))])
    for r in records:
        if r["budget"] is None:
            name = "full (reference)" if r["policy"] == "full" else "full, fact left out"
            rows.append([name, *_recall_cells(r) * len(specs)])
    r0 = records[0]
    title = (
        f"multi-turn recall: {r0['conversations']} conversations of {r0['turns']} turns (~{r0['tokens']} tokens), "
        "a fact stated in turn 1 or 2 and asked for in the last; greedy hits, and the share of the full cache's "
        "likelihood gain on the answer kept (budget: mean tokens per layer and head)"
    )
    return title, header, rows


def markdown(table: Table) -> str:
    title, header, rows = table
    lines = [
        f"**{title}**",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- figures -------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _label(policy: str, records: list[dict]) -> str:
    """A policy's legend entry: with the storage when its keys and values were held in 8 bits (--kv-quant)."""
    quant = next((r.get("kv_quant") for r in records if r["policy"] == policy), None)
    return f"{policy}, 8-bit KV" if quant == "8bit" else policy


def ppl_plot(records: list[dict], path: Path, title: str = "") -> None:
    """Perplexity against budget (log x), one line per policy; the full cache as a horizontal reference."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for policy in dict.fromkeys(r["policy"] for r in records if r["budget"] is not None):
        points = sorted((r["budget"], r["ppl"]) for r in records if r["policy"] == policy)
        ax.plot(*zip(*points, strict=True), marker="o", label=_label(policy, records))
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None})
    for r in records:
        if r["budget"] is None:
            ax.axhline(r["ppl"], color="black", linestyle="--", linewidth=1, label=f"full cache ({r['ppl']:.2f})")
    ax.set_xscale("log")
    ax.set_xticks(budgets, [f"{b}\n{100 * b / records[0]['tokens']:.0f}%" for b in budgets])
    ax.minorticks_off()
    values = [r["ppl"] for r in records]
    if max(values) / min(values) > 4:  # a window policy can be far off; keep the good ones readable
        ax.set_yscale("log")
    ax.set_xlabel("KV budget (tokens per layer and head; % of the text)")
    ax.set_ylabel("perplexity")
    ax.set_title(title or f"Teacher-forced perplexity, {records[0]['tokens']} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def needle_plot(records: list[dict], path: Path, title: str = "") -> None:
    """Heatmap: configurations x depths, colour = accuracy, each cell annotated correct/trials."""
    plt = _pyplot()
    depths = list(dict.fromkeys(r["depth"] for r in records))
    configs = list(dict.fromkeys((r["policy"], r["budget"]) for r in records))
    grid = [[0.0] * len(depths) for _ in configs]
    notes = [[""] * len(depths) for _ in configs]
    for r in records:
        i, j = configs.index((r["policy"], r["budget"])), depths.index(r["depth"])
        grid[i][j], notes[i][j] = r["accuracy"], f"{r['correct']}/{r['trials']}"
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(depths), 0.9 + 0.45 * len(configs)), dpi=120)
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i, row in enumerate(notes):
        for j, note in enumerate(row):
            ax.text(j, i, note, ha="center", va="center", fontsize=9)
    pct = {(r["policy"], r["budget"]): r["budget_pct"] for r in records}
    ax.set_yticks(range(len(configs)), [p if b is None else f"{p} {b} ({pct[p, b]:g}%)" for p, b in configs])
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("needle depth (share of the text before it)")
    ax.set_title(title or f"Needle retrieval, {records[0]['prompt_tokens']}-token prompts", fontsize=10)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def recall_plot(records: list[dict], path: Path, title: str = "") -> None:
    """Two panels against budget: the share of the full cache's likelihood gain kept, and greedy hits; one line
    per policy, the full cache (and the full cache without the fact) as horizontal references."""
    plt = _pyplot()
    fig, (gain_ax, hits_ax) = plt.subplots(1, 2, figsize=(9.6, 4.0), dpi=120)
    for policy in dict.fromkeys(r["policy"] for r in records if r["budget"] is not None):
        mine = sorted((r for r in records if r["policy"] == policy), key=lambda r: r["budget_pct"])
        pct = [r["budget_pct"] for r in mine]
        # no gain to keep (the full cache scores the answers as it does without the fact): a gap, not a crash
        gains = [nan if r["gain_kept"] is None else r["gain_kept"] for r in mine]
        line = gain_ax.plot(pct, gains, marker="o", label=_label(policy, records))[0]
        lows = [r["gain_kept_90"][0] if r.get("gain_kept_90") else g for r, g in zip(mine, gains, strict=True)]
        highs = [r["gain_kept_90"][1] if r.get("gain_kept_90") else g for r, g in zip(mine, gains, strict=True)]
        gain_ax.fill_between(pct, lows, highs, color=line.get_color(), alpha=0.12)
        hits_ax.plot(pct, [r["hits"] for r in mine], marker="o", label=_label(policy, records))
    for r in records:
        if r["budget"] is None:
            style = {"color": "black", "linewidth": 1, "linestyle": "--" if r["policy"] == "full" else ":"}
            label = "full cache" if r["policy"] == "full" else "full, fact left out"
            hits_ax.axhline(r["hits"], label=label, **style)
            gain_ax.axhline(1.0 if r["policy"] == "full" else 0.0, label=label, **style)
    gain_ax.set_ylabel("share of the full cache's likelihood gain kept")
    hits_ax.set_ylabel(f"greedy hits (of {records[0]['conversations']})")
    for ax in (gain_ax, hits_ax):
        ax.set_xlabel("KV budget (% of each conversation)")
        ax.grid(alpha=0.3)
    gain_ax.legend(fontsize=8)
    r0 = records[0]
    fig.suptitle(title or f"Multi-turn recall, {r0['conversations']} conversations of {r0['turns']} turns", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


TABLES = {"ppl": ppl_table, "needle": needle_table, "agree": agree_table, "recall": recall_table}


def main(argv: list[str] | None = None) -> None:
    """`python -m h2o_chat.measure.plots KIND RECORDS.jsonl`: print the markdown table of saved --json records."""
    import json
    import sys

    kind, path = argv or sys.argv[1:]
    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    print(markdown(TABLES[kind.split("_")[0]](records)), end="")  # e.g. ppl_prompt -> ppl


if __name__ == "__main__":
    main()
