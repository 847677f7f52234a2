"""Will it fit? Weights and KV cache sizes from a config, checked against free GPU memory (or, on CPU, the
machine's available memory) before loading. Every check counts what running takes at its peak: the cache's
storage with a decode step's transients or a prompt chunk's (the smallest chunk a prompt falls back to), so a
budget said to fit never runs past the memory it was checked against.

Parameters are counted on the meta device (exact for any architecture, no memory used). bitsandbytes keeps
the embeddings, the output head and the norms in the compute dtype and quantizes the Linear layers: NF4 packs
two weights per byte plus one fp32 absmax per 64 weights (double quantization shrinks that further), int8
stores one byte per weight plus per-row scales.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2o_chat.engine.policies import recall_rank
from h2o_chat.engine.step.attention import MASS_BLOCK  # the attention-mass block, in elements
from h2o_chat.engine.storage import store as recall_store
from h2o_chat.engine.storage.quant import bytes_per_element
from h2o_chat.engine.storage.slots import slot_bytes, storage_bytes
from h2o_chat.errors import DeviceError
from h2o_chat.models.cpu_quant import exact_channel_count

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
_LINEAR_BYTES = {"none": None, "8bit": 1.0 + 4 / 4096, "4bit": 0.5 + 4 / 64}
# h2o-chat's CPU packing (`cpu_quant`): int4 = the kernel's packed nibbles (held once) + a bfloat16 scale and zero
# per 32 weights; int8 = a byte + a bfloat16 scale per output channel (~1 byte)
_CPU_LINEAR_BYTES = {"none": None, "8bit": 1.0, "4bit": 0.5 + 4 / 32}
_CPU_HEAD_COPY_BYTES = {"none": 0.0, "8bit": 0.0, "4bit": 0.5 + 4 / 32}  # the LM head's 4-bit copy
OVERHEAD = 1.15  # CUDA context and allocator slack on top of weights + what running takes
SMALLEST_CHUNK = 16  # the smallest prompt chunk `fitting_chunk` falls back to


@dataclass(frozen=True)
class Footprint:
    linear_params: int
    other_params: int
    layers: int
    kv_heads: int
    head_dim: int
    kv_quant: str = "none"  # "8bit": the cache holds keys and values in int8 with a scale per token
    table_params: int = 0  # the embedding and LM head tables (once if tied), within other_params
    head_params: int = 0  # the LM head's table alone
    store_tokens: int = 0  # the recall policy's store: evicted tokens kept per row (allocated beside the slots)
    shape: ModelShape | None = None  # the sizes a step's and a chunk's transients follow (None: storage alone)
    head_columns: int = 0  # the LM head's int8 columns kept beside its CPU 4-bit copy (`cpu_quant`)

    def weight_bytes(self, dtype: torch.dtype, quantize: str = "none", cpu: bool = False) -> int:
        """As held: bitsandbytes on a GPU keeps the tables in `dtype`; the CPU packing holds them in int8."""
        per = _DTYPE_BYTES[dtype]
        linear = (_CPU_LINEAR_BYTES if cpu else _LINEAR_BYTES)[quantize] or per
        tables = 1.0 if cpu and quantize != "none" else per
        rest = self.other_params - self.table_params
        head_copy = self.head_params * _CPU_HEAD_COPY_BYTES[quantize] if cpu else 0
        if cpu and quantize == "4bit":
            head_copy += self.head_columns
        return int(self.linear_params * linear + self.table_params * tables + rest * per + head_copy)

    def token_bytes(self, dtype: torch.dtype) -> int:
        """One token's slot in every layer and KV head of a row, as the cache stores it (`slots.slot_bytes`)."""
        elem = dtype.itemsize
        return self.layers * self.kv_heads * slot_bytes(self.head_dim, self.head_dim, elem, self.kv_quant)

    def kv_bytes(self, tokens: int, dtype: torch.dtype, batch: int = 1) -> int:
        """The cache's storage for a budget of `tokens` per row, exactly as `Slots.allocate` makes it (the spare
        slot, positions, rotations, scores and scales included): `slots.storage_bytes`."""
        if tokens <= 0:
            return 0
        elem = dtype.itemsize
        hd = self.head_dim
        return storage_bytes(self.layers, batch, self.kv_heads, tokens, hd, hd, elem, self.kv_quant) + self.store(batch)

    def store(self, batch: int = 1) -> int:
        """The recall store's bytes for `batch` rows (`store.store_bytes`; 0 without one)."""
        if not self.store_tokens:
            return 0
        hd = self.head_dim
        return recall_store.store_bytes(self.layers, batch, self.kv_heads, hd, hd, self.store_tokens)

    def run_bytes(self, tokens: int, dtype: torch.dtype, batch: int = 1, snap: bool = False) -> int:
        """Beyond the weights, at the peak of running a cache of `tokens` per row: `peak_bytes` when the model's
        shape is known, else the storage alone."""
        if tokens <= 0:
            return 0
        if self.shape is None:
            return self.kv_bytes(tokens, dtype, batch)  # the store included
        shape = dataclasses.replace(self.shape, kv_quant=self.kv_quant)
        return peak_bytes(shape, dtype.itemsize, batch, tokens, snap=snap) + self.store(batch)

    def budget_fitting(self, free: float, dtype: torch.dtype, batch: int = 1, snap: bool = False) -> int:
        """The largest budget whose run (`run_bytes`, with the overhead) fits in `free` bytes (0: none)."""
        per_row = self.kv_bytes(1, dtype) - self.token_bytes(dtype)  # the spare slot, the row's counters, a store
        hi = max(0, int((free / OVERHEAD / batch - per_row) // self.token_bytes(dtype))) + 1  # storage alone
        return largest(lambda tokens: OVERHEAD * self.run_bytes(tokens, dtype, batch, snap) <= free, hi)

    def total_bytes(
        self, dtype: torch.dtype, quantize: str, kv_tokens: int, batch: int = 1, cpu: bool = False, snap: bool = False
    ) -> int:
        weights = self.weight_bytes(dtype, quantize, cpu)
        return math.ceil(OVERHEAD * (weights + self.run_bytes(kv_tokens, dtype, batch, snap)))  # up: as the chunk's


def footprint(config) -> Footprint:
    """Count a model's parameters from its config without allocating anything."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out_head = model.get_output_embeddings()
    head_weight = out_head.weight if out_head is not None else None
    linear = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not head_weight
    )
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    tables = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), out_head) if m is not None}
    return Footprint(
        linear_params=linear,
        other_params=total - linear,
        **_kv_shape(config),
        table_params=sum(tables.values()),
        head_params=head_weight.numel() if head_weight is not None else 0,
        shape=ModelShape.of(config),
        head_columns=head_weight.shape[0] * exact_channel_count(head_weight.shape[1]) if head_weight is not None else 0,
    )


def _kv_shape(config) -> dict[str, int]:
    text = config.get_text_config()
    heads = text.num_attention_heads
    return {
        "layers": text.num_hidden_layers,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
    }


def kv_token_bytes(config, dtype: torch.dtype, kv_quant: str = "none") -> int:
    """Bytes one token's slot takes in every layer, as the cache stores it (a row): `Footprint.token_bytes`."""
    return Footprint(0, 0, **_kv_shape(config), kv_quant=kv_quant).token_bytes(dtype)


def gb(n: float) -> str:
    """Bytes for a message: GB with one decimal, or MB below a tenth of a GB (a tiny model's needs)."""
    return f"{n / 2**30:.1f} GB" if n >= 0.1 * 2**30 else f"{n / 2**20:.1f} MB"


def check_fits(
    name: str,
    fp: Footprint,
    dtype: torch.dtype,
    quantize: str,
    kv_tokens: int,
    free_bytes: int,
    rows: int = 1,
    gpu: bool = True,
) -> None:
    """Raise a DeviceError saying what would fit when the weights plus a KV cache of `kv_tokens` for each of
    `rows` batch rows do not fit in `free_bytes` (of the GPU, or of this machine's memory when not `gpu`)."""
    cpu = not gpu
    need = fp.total_bytes(dtype, quantize, kv_tokens, rows, cpu)
    if need <= free_bytes:
        return
    options = []
    for q in ("4bit", "8bit", "none"):
        if q != quantize and fp.total_bytes(dtype, q, kv_tokens, rows, cpu) <= free_bytes:
            options.append(f"--quantize {q} needs ~{gb(fp.total_bytes(dtype, q, kv_tokens, rows, cpu))}")
    weights_only = fp.total_bytes(dtype, quantize, 0, cpu=cpu)
    if weights_only <= free_bytes:  # the weights fit: a smaller budget would
        budget = fp.budget_fitting(free_bytes - weights_only, dtype, rows)
        if budget >= 64:
            options.append(f"--budget {budget} fits" + (f" with {rows} rows (--batch-size)" if rows > 1 else ""))
    store = _store_fitting(fp, dtype, quantize, kv_tokens, free_bytes, rows, cpu)
    if store is not None:  # the weights and the budget fit: recall's store is what does not
        options.append(f"--recall-memory {store} fits" if store else "no recall store fits: -p snap keeps none")
    where = "on this GPU" if gpu else "in this machine's memory"
    hint = "; ".join(options) if options else f"no setting fits {where}: try a smaller model"
    cache = _cache_words(kv_tokens, rows, fp.kv_quant, fp.store_tokens)
    has = f"the GPU has {gb(free_bytes)} free" if gpu else f"this machine has {gb(free_bytes)} of memory available"
    kind = str(dtype).removeprefix("torch.")
    weights = f"{kind} weights" if quantize == "none" else f"{quantize.replace('bit', '-bit')} weights ({kind} compute)"
    raise DeviceError(f"{name} with {weights} and {cache} needs ~{gb(need)}, but {has}; {hint}")


def _store_fitting(fp: Footprint, dtype, quantize: str, kv_tokens: int, free: int, rows: int, cpu: bool) -> int | None:
    """The most evicted tokens recall's store can keep (per row, layer and head) beside these weights and this
    budget in `free` bytes; None when there is no store, or when the run does not fit without one either."""
    if not fp.store_tokens:
        return None
    fits = lambda tokens: (  # noqa: E731
        dataclasses.replace(fp, store_tokens=tokens).total_bytes(dtype, quantize, kv_tokens, rows, cpu) <= free
    )
    return largest(fits, fp.store_tokens) if fits(0) else None


def largest(fits: Callable[[int], bool], hi: int, lo: int = 0) -> int:
    """The largest n in [lo, hi) for which `fits(n)`, `fits` holding up to some n and not past it (`lo` is taken
    to fit: the caller knows); by bisection."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _cache_words(kv_tokens: int, rows: int, kv_quant: str, store_tokens: int = 0) -> str:
    bits = " in 8 bits" if kv_quant == "8bit" else ""
    store = f" and a store of {store_tokens:,} evicted tokens (--recall-memory)" if store_tokens else ""
    return f"a {kv_tokens}-token KV cache{bits}{store}" + (f" for each of {rows} rows" if rows > 1 else "")


def check_fits_in_memory(
    name: str,
    config,
    dtype: torch.dtype,
    kv_tokens: int,
    rows: int = 1,
    kv_quant: str = "none",
    quantize="none",
    store_tokens: int = 0,
) -> None:
    """On CPU: the KV cache (and recall's store) is allocated whole at the first token, so a budget beyond this
    machine's memory fails there with "can't allocate"; say before loading which budget would fit."""
    available = available_memory()
    shape = ModelShape.of(config)
    run = Footprint(0, 0, **_kv_shape(config), kv_quant=kv_quant, store_tokens=store_tokens, shape=shape)
    if OVERHEAD * run.run_bytes(kv_tokens, dtype, rows) < available / 4:  # far from the limit: parameters uncounted
        return
    fp = dataclasses.replace(footprint(config), kv_quant=kv_quant, store_tokens=store_tokens)
    check_fits(name, fp, dtype, quantize, kv_tokens, available, rows=rows, gpu=False)


def check_budget(
    config,
    dtype: torch.dtype,
    device: torch.device,
    kv_tokens: int,
    rows: int = 1,
    flag: str = "--budget",
    kv_quant: str = "none",
    snap: bool = False,
) -> None:
    """With the weights already loaded (a budget changed in the chat, a batch line's own budget, a server's new
    rows): the same check as before loading, for the cache's run alone (storage and a step's or a chunk's
    transients; `snap`: its probe's copy too) against what is free now -- raise a DeviceError saying which `flag`
    value would fit when a cache of `kv_tokens` for each of `rows` rows would not."""
    fp = Footprint(0, 0, **_kv_shape(config), kv_quant=kv_quant, shape=ModelShape.of(config))
    gpu = device.type == "cuda"
    free = free_gpu_bytes(device) if gpu else available_memory()
    need = fp.total_bytes(dtype, "none", kv_tokens, rows, snap=snap)
    if need <= free:
        return
    fits = fp.budget_fitting(free, dtype, rows, snap)
    has = f"the GPU has {gb(free)} free" if gpu else f"this machine has {gb(free)} of memory available"
    cache = _cache_words(kv_tokens, rows, kv_quant)
    raise DeviceError(f"{flag} {kv_tokens}: {cache} needs ~{gb(need)}, but {has}; {flag} {fits} fits")


def available_memory() -> int:
    """Bytes this machine can still give the process (psutil's available: free plus reclaimable)."""
    import psutil

    return psutil.virtual_memory().available


def process_memory(device: torch.device | None = None) -> dict[str, int]:
    """Resident memory of this process, and GPU memory (allocated, reserved) when `device` is a GPU or, without
    a device, when CUDA is in use (bytes)."""
    import psutil

    out = {"rss": psutil.Process().memory_info().rss}
    cuda = device.type == "cuda" if device is not None else torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        out["gpu_allocated"] = torch.cuda.memory_allocated(device)
        out["gpu_reserved"] = torch.cuda.memory_reserved(device)
    return out


def free_gpu_bytes(device: torch.device | None = None) -> int:
    """Free memory on the GPU a model runs on (`device`; None: the current one): h2o-chat runs a model on one
    device (`loading.check_one_device`), so other GPUs' memory would not hold it."""
    return torch.cuda.mem_get_info(device)[0]


# -- what reading a prompt and decoding need beyond the weights ----------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a forward's transient memory."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    kv_quant: str = "none"  # how the cache stores keys and values (`quant.py`)

    @classmethod
    def of(cls, config) -> ModelShape:
        text = config.get_text_config()
        kv = _kv_shape(config)
        intermediate = (
            getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None) or 4 * text.hidden_size
        )
        return cls(
            kv["layers"], text.num_attention_heads, kv["kv_heads"], kv["head_dim"], text.hidden_size,
            intermediate, text.vocab_size,
        )  # fmt: skip


def cache_storage_bytes(shape: ModelShape, elem: int, rows: int, capacity: int) -> int:
    """The cache's storage: `capacity` slots and a spare, every layer, row and KV head (`slots.storage_bytes`)."""
    hd = shape.head_dim
    return storage_bytes(shape.layers, rows, shape.kv_heads, capacity, hd, hd, elem, shape.kv_quant)


def _stored_elem(shape: ModelShape) -> float | None:
    """Bytes per stored key/value element when narrower than the model's dtype (8-bit storage), else None."""
    return None if shape.kv_quant == "none" else bytes_per_element(shape.kv_quant, torch.float32, shape.head_dim)


def store_bytes(shape: ModelShape, rows: int, stored: int) -> int:
    """The recall policy's store of `stored` entries per row, as it is allocated (`store.store_bytes`)."""
    hd = shape.head_dim
    return recall_store.store_bytes(shape.layers, rows, shape.kv_heads, hd, hd, stored)


def prefill_bytes(
    shape: ModelShape,
    elem: int,
    rows: int,
    capacity: int,
    chunk: int,
    snap: bool = False,
    window: int = 16,
    mass: bool = True,
    recall: int = 0,
    stored: int | None = None,
    rank_block: int = recall_rank.RANK_BLOCK,
) -> int:
    """Peak bytes beyond the weights while a prompt is read in chunks of `chunk` columns: the storage, every
    layer's keys and values of the chunk (placed together when the forward ends), one layer's attention
    (keys of slots and chunk together, the mask, one block of the mass's logits and fp32 probabilities) and
    activations, and the last logits. Snap's probe reads into a second storage, and its observation logits
    (per slot and window query) live beside the slots. `mass`: the policy tracks attention mass (h2o, snap);
    the others read with the fused kernel alone.

    `recall`: tokens a chunk brings back from the recall policy's store (per row and KV head), attended before
    the slots with a mask per KV head (repeated per query head for the fused kernel). `stored`: the store's
    entries per row (it is allocated beside the slots, on their device): the store itself, and its ranking's
    transients (one block of first-pass logits, `rank_block` of them: the device's, the candidates' keys in fp32)."""
    B, T, N = rows, chunk, capacity + chunk + recall
    L, H, Hq, D = shape.layers, shape.kv_heads, shape.heads, shape.head_dim
    stash = L * B * H * T * (2 * D * elem + 4)
    layer_keys = B * H * N * 2 * D * elem
    mask = B * T * N * elem
    block = min(B * Hq * T * N, MASS_BLOCK) * (2 * elem + 4 + 4) if mass else 0  # logits (+ mask), probabilities
    activations = B * T * (4 * shape.hidden + 3 * shape.intermediate + 2 * (Hq + 2 * H) * D) * elem
    logits = B * shape.vocab * 4 * 2
    total = cache_storage_bytes(shape, elem, B, capacity) + stash + layer_keys + mask + block + activations + logits
    if recall:
        total += B * H * recall * 2 * D * elem  # the recalled keys and values, before they join the slots'
        total += B * (H + Hq) * T * N * elem + B * H * T * recall * (elem + 1)  # per-head masks, their front
    if stored:
        n, cand = stored + 1, min(stored, recall_rank.CANDIDATES * recall)
        rank = recall_store.rank_dim_for(D)  # a block of logits; the coordinates read as fp32; the best so far
        ranking = min(B * Hq * T * n, rank_block) * 4 + B * H * n * (rank * 4 + 4 + 8 + 16)
        ranking += B * H * cand * (D * 4 + 8) + min(B * Hq * T * cand, rank_block) * 4  # candidates
        total += store_bytes(shape, B, stored) + ranking
    if snap:
        G = Hq // H
        total += cache_storage_bytes(shape, elem, B, capacity)  # the probe's copy (pass 1)
        total += L * B * H * (capacity + 1 + T) * G * window * 4 * 2  # observation logits (pass 2)
    return int(total)


def peak_bytes(
    shape: ModelShape, elem: int, rows: int, capacity: int, chunk: int = SMALLEST_CHUNK, snap: bool = False
) -> int:
    """Beyond the weights, the most a cache of `capacity` per row takes while it runs: its storage with a decode
    step's transients, or with a prompt chunk's (of `chunk` columns, the attention mass counted), whichever is
    more. A longer chunk is read only where it fits (`prefill_chunk`)."""
    return max(decode_bytes(shape, elem, rows, capacity), prefill_bytes(shape, elem, rows, capacity, chunk, snap=snap))


def decode_bytes(shape: ModelShape, elem: int, rows: int, capacity: int) -> int:
    """Peak bytes beyond the weights for a decode step: the storage, the step's attention over every slot in
    fp32, the eviction's per-slot priorities and sort keys for every layer, one layer's activations, the logits
    and the sampler's copies of them."""
    B = rows
    attention = B * shape.heads * (capacity + 1) * 4 * 3
    eviction = shape.layers * B * shape.kv_heads * (capacity + 1) * 48
    activations = B * (4 * shape.hidden + 3 * shape.intermediate) * elem
    logits = B * shape.vocab * 4 * 4
    return cache_storage_bytes(shape, elem, B, capacity) + attention + eviction + activations + logits


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can use now: the GPU's free memory, or this machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def fitting_chunk(
    shape: ModelShape,
    elem: int,
    rows: int,
    capacity: int,
    chunk: int,
    available: int,
    held: int = 0,
    snap: bool = False,
    window: int = 16,
    mass: bool = True,
    smallest: int = SMALLEST_CHUNK,
    recall: int = 0,
    stored: int | None = None,
    rank_block: int = recall_rank.RANK_BLOCK,
) -> int:
    """The largest chunk, `chunk` or a smaller power of two, whose prefill fits in `available` bytes (plus the
    `held` bytes the cache's storage already occupies, which the estimate counts); DeviceError when even
    `smallest` does not fit."""
    smallest = min(chunk, smallest)
    sizes = [chunk]
    while sizes[-1] // 2 >= smallest:
        sizes.append(sizes[-1] // 2)
    if sizes[-1] != smallest:  # halving 300 ends at 18: the fit checks promise that 16 can be read
        sizes.append(smallest)

    def need(size: int) -> float:
        knobs = dict(snap=snap, window=window, mass=mass, recall=recall, stored=stored, rank_block=rank_block)
        return OVERHEAD * prefill_bytes(shape, elem, rows, capacity, size, **knobs)

    for size in sizes:
        if need(size) <= available + held:
            return size
    lower = "--budget (or /budget), --recall-memory" if stored else "--budget (or /budget)"
    raise DeviceError(
        f"reading this prompt needs ~{gb(need(smallest))} for its KV cache and a chunk of {smallest} tokens, "
        f"but {gb(available + held)} is available; lower {lower} or the number of rows"
    )


def prefill_chunk(model, cache, rows: int, tokens: int, chunk: int | None) -> tuple[int, str | None]:
    """The chunk to read a prompt of `tokens` into `cache` with: `chunk` (None: the device's default), or a smaller
    one that fits this device's free memory (with a note saying so); DeviceError, one line, when even a small one
    does not fit."""
    from h2o_chat.engine.step.prefill import default_chunk

    device = next(model.parameters()).device
    chunk = chunk or default_chunk(device)
    dtype = cache.slots.dtype if cache.slots is not None else next(model.parameters()).dtype
    if not dtype.is_floating_point:  # quantized weights compute in half precision
        dtype = torch.float16
    elem = torch.tensor([], dtype=dtype).element_size()
    shape = ModelShape.of(model.config)
    shape = dataclasses.replace(shape, kv_quant=cache.kv_quant)
    policies = [g.policy for g in cache.groups]
    snap = next((p for p in policies if p.compresses_prompts), None)
    recalled = max((getattr(p, "recalled", 0) for p in policies), default=0)  # the recall policy's rows
    store = cache.store
    held = cache.storage_bytes()
    stored = max((getattr(p, "store", 0) for p in policies), default=0)  # entries per row (allocated at once)
    if store is not None:
        held += store.nbytes()
    size = fitting_chunk(
        shape,
        elem,
        rows,
        cache.capacity_for(tokens),
        min(chunk, max(1, tokens)),
        available_bytes(device),
        held=held,
        snap=snap is not None,
        window=getattr(snap, "window", 16),
        mass=any(p.by_score for p in policies),
        recall=recall_rank.CHUNK_TIMES * recalled,
        stored=stored,
        rank_block=recall_rank.rank_block(device),
    )
    if size >= min(chunk, tokens):
        return chunk, None
    return size, f"reading in chunks of {size} tokens instead of {chunk}: a larger chunk would not fit in memory"
