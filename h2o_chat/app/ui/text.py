"""Words and numbers as the user reads them: durations, bytes, shares, quotes cut at a word, the one-line
summaries of a cache, a policy and a device, and the console every front end prints with."""

from __future__ import annotations

import math
import os

from rich.console import Console

COMPACT_BELOW = 80  # columns: below this the panel is two plain lines


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def share(fraction: float) -> str:
    """A share as a whole percent, rounded down: a message that lost a token reads 99%, never 100%."""
    return "100%" if fraction >= 1 - 1e-6 else f"{min(99, math.floor(100 * fraction))}%"


def quote(text: str, width: int = 48) -> str:
    """`text` on one line in at most `width` characters, cut between words and marked with "…" (a cut inside a
    word or a number misquotes it: "costs 12" for "costs 1250")."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    cut = flat.rfind(" ", 0, width)
    return (flat[:cut] if cut > 0 else flat[: width - 1]) + "…"


def fit(text: str, width: int) -> str:
    """`text` in `width` columns, never cut inside a word: whole clauses (before ", ", "; ", " (", " | ") leave
    from the end while what stays fills at least half the width, else whole words; " …" marks the cut."""
    if len(text) <= width:
        return text
    room = width - 2  # for " …"
    clause = max(text.rfind(sep, 0, room + 1) for sep in (", ", "; ", " (", " | "))
    cut = clause if clause >= width // 2 else text.rfind(" ", 0, room + 1)
    if cut <= 0:  # one word longer than the width
        return text[: width - 1] + "…"
    return text[:cut].rstrip(" ,;|(") + " …"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 token', '2 tokens', '1,024 tokens'."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def reading_label(total: int, prompt_tokens: int) -> str:
    """What a prompt-reading bar says: snap's probe reads a prompt that overflows the budget first, then the
    prompt is read again, so one bar counts both passes."""
    if not prompt_tokens or total <= prompt_tokens:
        return "reading the prompt"
    return "reading the prompt (twice: snap)"


NOT_TIMED = "no decode step to time"  # a 1-token reply: its token comes from the prompt's reading


def summary_line(
    response, stats, decode: str = "", speeds: tuple[float, float, float] | None = None, weights: str = ""
) -> str:
    """One line for stderr after a piped run; `decode` says how decode steps ran (eager, CUDA graph, ...);
    `speeds` are (prompt tok/s, decode tok/s or None when no decode step ran, one-time setup seconds) with the
    setup (a capture or compilation) left out of both speeds, which is then stated apart."""
    prompt_tps, decode_tps, setup = speeds or (response.prompt_tps, response.generation_tps, 0.0)
    steps = f", {decode}" if decode else ""
    rate = NOT_TIMED if decode_tps is None else f"{decode_tps:.1f} tok/s{steps}"
    once = f"; one-time setup {setup:.1f} s, not in tok/s" if setup >= 0.05 else ""
    return (
        f"{plural(response.generation_tokens, 'token')}, {rate} "
        f"(prompt {plural(response.prompt_tokens, 'token')}, {prompt_tps:.0f} tok/s{once}) | "
        f"cache {describe_policy(stats)}: kept {stats.kept:,.0f} of {stats.seen:,} seen, "
        f"evicted {stats.evicted:,.0f} | KV {describe_kv(stats)}" + (f" | weights {weights}" if weights else "")
    )


def describe_kv(stats, width: int | None = None) -> str:
    """What the KV cache allocated (the whole budget, from the first token), what the held tokens use, and
    what a full cache would hold for the same tokens: e.g. '22.5 MB allocated, 2.0 MB in use; a full cache
    would hold 2.0 MB'. Allocated alone beside the full figure made H2O look worse than no eviction. `width`:
    the columns it has (the panel's row): the first wording that fits, down to 'alloc'/'used'/'full'; with it the
    recall store is left to the evicted row."""
    held = " in 8 bits" if stats.kv_quant == "8bit" else ""
    alloc, used, full = human_bytes(stats.kv_bytes), human_bytes(stats.kv_used_bytes), human_bytes(stats.full_kv_bytes)
    share = ""
    if stats.full_kv_bytes and stats.kv_bytes < stats.full_kv_bytes:
        share = f"{100 * stats.kv_bytes / stats.full_kv_bytes:.0f}%"
    forms = [
        f"{alloc} allocated{held}, {used} in use; a full cache would hold {full}"
        + (f" ({share} allocated)" if share else ""),
        f"{alloc} allocated{held}, {used} in use; full cache {full}" + (f" ({share})" if share else ""),
        f"{alloc} alloc{held}, {used} used; full {full}" + (f" ({share})" if share else ""),
    ]
    if width is not None:
        return next((form for form in forms if len(form) <= width), forms[-1])
    kv = forms[0]
    if stats.store_bytes:  # recall: the store of evicted tokens, allocated once beside the slots
        kv += f"; evicted tokens kept for recall {human_bytes(stats.store_bytes)} ({describe_store(stats)})"
    return kv


def describe_store(stats) -> str:
    """What recall's store holds: '1,234 of 4,096 tokens, 10 dropped' (per layer, row and head)."""
    dropped = f", {stats.store_dropped:,.0f} dropped" if stats.store_dropped else ""
    return f"{stats.store_tokens:,.0f} of {stats.store_capacity:,} tokens{dropped}"


def describe_policy(stats) -> str:
    if stats.budget is None:
        return stats.policy
    split = " + ".join(f"{v} {k}" for k, v in stats.split.items() if v)
    return f"{stats.policy} {stats.budget} ({split})"


def make_console(stderr: bool = False) -> Console:
    """Rich console honouring NO_COLOR; plain when not a terminal. Text is not wrapped unless asked for
    (`wrap` below): streamed replies and echoed input keep their own lines."""
    return Console(stderr=stderr, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, soft_wrap=True)


def wrap(console: Console, renderable, **kwargs) -> None:
    """Print a line of ours (a banner, a note, a status line) wrapped at word boundaries to the terminal's
    width, so that the terminal never cuts it mid-word; pipes and files keep it on one line."""
    console.print(renderable, soft_wrap=not console.is_terminal, **kwargs)


def describe_device(loaded) -> str:
    """e.g. 'cpu, float32' or 'cuda:0 NVIDIA H100, 4bit (bfloat16 compute)'."""
    device = loaded.device
    name = str(device)
    if device.type == "cuda":
        import torch

        name += " " + torch.cuda.get_device_name(device)
    dtype = str(loaded.dtype).removeprefix("torch.")
    if loaded.quantize != "none":
        return f"{name}, {describe_weights(loaded)}, {dtype} compute"
    return f"{name}, {describe_weights(loaded)}"


def describe_machine(loaded) -> str:
    """Where a figure was measured: e.g. 'AMD EPYC 7B13, 2 threads, torch 2.13.0+cpu' or 'NVIDIA H200, torch
    2.11.0+cu130' (the processors of our machines vary: a figure is compared only with one of the same)."""
    import torch

    if loaded.device.type == "cuda":
        where = torch.cuda.get_device_name(loaded.device)
    else:
        where = f"{processor_name()}, {plural(torch.get_num_threads(), 'thread')}"
    return f"{where}, torch {torch.__version__}"


def processor_name() -> str:
    """The CPU's model name as the kernel gives it, else what Python knows of the processor."""
    import platform

    from h2o_chat.files import cpu_info

    name = " ".join((cpu_info("model name") or "").split())
    return name or platform.processor() or platform.machine() or "an unknown processor"


def describe_weights(loaded) -> str:
    """The weights' format and bytes as held: e.g. 'int4 groups of 32, int8 embedding, 141 MB'."""
    size = f", {human_bytes(loaded.weight_bytes)}" if getattr(loaded, "weight_bytes", 0) else ""
    return f"{loaded.weights}{size}"
