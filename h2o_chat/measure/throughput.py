"""The paper's metric: generation throughput at a fixed memory limit.

At a fixed memory limit, a full cache must hold prompt + generated tokens for every row, so few rows fit;
H2O holds `budget` tokens per row, so the batch can be much larger and tokens/s over the batch grows. The
batch for each configuration is the largest whose weights + KV cache (+ slack) fit the limit, as the
`memory.Footprint` estimate says; the run then reports the peak memory it really used. Both configurations
decode through the same engine. (Random-weight models of real shapes: `h2o_chat.models.shapes`.)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.decode import Engine, sync
from h2o_chat.engine.policies import make_policy
from h2o_chat.models.memory import OVERHEAD, footprint, process_memory


@dataclass(frozen=True)
class ThroughputRecord:
    config: str
    budget: int | None
    batch: int
    prompt_tokens: int
    generated_tokens: int
    tokens_per_second: float
    kv_bytes: int
    peak_bytes: int
    memory_limit: int
    device: str
    decode: str = "eager"  # how decode steps ran (the same engine for both configurations)
    setup_seconds: float = 0.0  # graph capture or compilation, not counted in tokens_per_second


def largest_batch(fp, dtype, weight_bytes: int, kv_tokens: int, limit: int, config, chunk: int) -> int:
    """The most rows whose KV cache and per-row transients fit beside the weights under `limit`. Transients
    per row: a prefill chunk's fp32 attention logits and its MLP activations, and the last fp32 logits."""
    text = config.get_text_config()
    hidden, heads = text.hidden_size, text.num_attention_heads
    elem = fp.kv_bytes(1, dtype) // (2 * fp.layers * fp.kv_heads * fp.head_dim)
    transient = chunk * (heads * (kv_tokens + chunk) * 4 + 16 * hidden * elem) + 4 * text.vocab_size
    per_row = OVERHEAD * (fp.kv_bytes(kv_tokens, dtype) + transient)
    return max(0, int((limit - OVERHEAD * weight_bytes) // per_row))


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return process_memory(device)["rss"]


@torch.inference_mode()
def run_throughput(
    loaded,
    memory_limit: int,
    prompt_tokens: int = 512,
    generated_tokens: int = 1536,
    budget: int = 512,
    max_batch: int = 256,
    chunk: int = 512,
    decode: str = "auto",
    progress=None,
) -> list[ThroughputRecord]:
    """Tokens/s over a batch for a full cache and for h2o at `budget`, each at the largest batch that fits,
    both decoded by the same engine (captured on CUDA). Warm-up steps (and the capture) are not timed.
    `progress(done, total)` counts each configuration's prompt columns and decode steps."""
    model = loaded.model
    device = next(model.parameters()).device
    dtype = loaded.dtype
    fp = footprint(model.config)
    vocab = model.config.get_text_config().vocab_size
    weights = fp.weight_bytes(dtype, loaded.quantize)
    total = prompt_tokens + generated_tokens
    warmup = min(4, generated_tokens - 1)
    out = []
    plans = (("full", make_policy("full"), total), ("h2o", make_policy("h2o", budget), budget))
    for k, (config, policy, cap) in enumerate(plans):
        batch = min(max_batch, largest_batch(fp, dtype, weights, cap, memory_limit, model.config, chunk))
        before = k * total  # tokens of the configurations already run
        report = None if progress is None else (lambda done, _of, before=before: progress(before + done, 2 * total))
        if batch == 0:
            out.append(ThroughputRecord(config, cap, 0, prompt_tokens, 0, 0.0, 0, 0, memory_limit, device.type))
            if report:
                report(total, total)
            continue
        cache = H2OCache.for_model(model, policy, "absolute", context=total + 1)
        cache.reserve(total)  # the full cache holds every token, allocated once
        engine = Engine(model, cache, decode)
        ids = torch.randint(3, vocab, (batch, prompt_tokens), device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        token = engine.first_tokens(engine.prefill(ids, chunk_size=chunk, progress=report))
        for i in range(warmup):
            engine.decode(token if i == 0 else None)
        sync(device)
        t = time.perf_counter()
        for i in range(generated_tokens - 1 - warmup):
            engine.decode()
            if report:
                report(prompt_tokens + warmup + i + 1, total)
        sync(device)
        if report:
            report(total, total)
        seconds = time.perf_counter() - t
        timed = generated_tokens - 1 - warmup
        out.append(
            ThroughputRecord(
                config,
                cap,
                batch,
                prompt_tokens,
                generated_tokens,
                round(batch * timed / seconds, 2) if timed > 0 else 0.0,
                cache.stats().kv_bytes,
                _peak(device),
                memory_limit,
                device.type,
                engine.mode,
                round(engine.setup_seconds, 2),
            )
        )
        del cache, engine
    return out


def as_dicts(records: list[ThroughputRecord]) -> list[dict]:
    return [asdict(r) for r in records]
