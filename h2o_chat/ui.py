"""Rendering only: the live stats panel, streamed text, summaries. It is handed records and prints them.

Nothing here decides anything about generation; the chat loop and the CLI call in with what to show.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def process_memory() -> dict[str, int]:
    """Resident memory of this process, and GPU memory when CUDA is in use (bytes)."""
    import psutil

    out = {"rss": psutil.Process().memory_info().rss}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_allocated"] = torch.cuda.memory_allocated()
        out["gpu_reserved"] = torch.cuda.memory_reserved()
    return out


def summary_line(response, stats) -> str:
    """One line for stderr after a piped run."""
    return (
        f"{response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s "
        f"(prompt {response.prompt_tokens} tokens, {response.prompt_tps:.0f} tok/s) | "
        f"cache {describe_policy(stats)}: kept {stats.kept:.0f} of {stats.seen} seen, "
        f"evicted {stats.evicted:.0f} | KV {human_bytes(stats.kv_bytes)} vs {human_bytes(stats.full_kv_bytes)} full"
    )


def describe_policy(stats) -> str:
    if stats.budget is None:
        return stats.policy
    split = " + ".join(f"{v} {k}" for k, v in stats.split.items() if v)
    return f"{stats.policy} {stats.budget} ({split})"


def make_console(stderr: bool = False, force_plain: bool = False) -> Console:
    """Rich console honouring NO_COLOR; plain when not a terminal."""
    return Console(
        stderr=stderr, no_color=bool(os.environ.get("NO_COLOR")) or force_plain, highlight=False, soft_wrap=True
    )


@dataclass
class TurnStats:
    """What the panel shows about the current turn."""

    evicted_at_start: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    tokens: int = 0


@dataclass
class PanelView:
    """The live panel: model, device, policy, budget split, tokens, evictions, memory, speed."""

    model: str
    device: str
    turn: TurnStats = field(default_factory=TurnStats)

    def render(self, stats) -> Panel:
        mem = process_memory()
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_column(style="bold")
        grid.add_column()
        kv = f"{human_bytes(stats.kv_bytes)} of {human_bytes(stats.full_kv_bytes)} full"
        if stats.full_kv_bytes:
            kv += f" ({100 * stats.kv_bytes / stats.full_kv_bytes:.0f}%)"
        memory = f"RSS {human_bytes(mem['rss'])}"
        if "gpu_allocated" in mem:
            memory += (
                f" | GPU {human_bytes(mem['gpu_allocated'])} alloc, {human_bytes(mem['gpu_reserved'])} "
                f"reserved, KV {100 * stats.kv_bytes / max(1, mem['gpu_allocated']):.0f}%"
            )
        grid.add_row("model", self.model, "device", self.device)
        grid.add_row("policy", describe_policy(stats), "tokens", f"{stats.seen} seen, {stats.kept:.0f} kept/layer")
        grid.add_row(
            "evicted",
            f"{stats.evicted - self.turn.evicted_at_start:.0f} this turn, {stats.evicted:.0f} total",
            "KV cache",
            kv,
        )
        grid.add_row(
            "memory",
            memory,
            "speed",
            f"prefill {self.turn.prompt_tps:.0f} tok/s, decode {self.turn.generation_tps:.1f} tok/s",
        )
        return Panel(grid, title="h2o-chat", title_align="left", border_style="dim")


class StreamView:
    """Streams a reply with the panel live beneath it (terminal), or as plain text (anything else)."""

    def __init__(self, console: Console, panel: PanelView | None):
        self.console = console
        self.panel = panel
        self.text = Text()
        self.live: Live | None = None

    def __enter__(self) -> StreamView:
        if self.panel is not None:
            self.live = Live(console=self.console, refresh_per_second=8, transient=False, vertical_overflow="visible")
            self.live.__enter__()
        return self

    def update(self, piece: str, stats) -> None:
        if self.live is None:
            self.console.file.write(piece)
            self.console.file.flush()
            return
        self.text.append(piece)
        self.live.update(Group(self.text, self.panel.render(stats)))

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
        else:
            self.console.file.write("\n")
            self.console.file.flush()
