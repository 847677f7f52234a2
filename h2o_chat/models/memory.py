"""Will it fit? Weights and KV cache sizes from a config, checked against free GPU memory (or, on CPU, the
machine's available memory) before loading.

Parameters are counted on the meta device (exact for any architecture, no memory used). bitsandbytes keeps
the embeddings, the output head and the norms in the compute dtype and quantizes the Linear layers: NF4 packs
two weights per byte plus one fp32 absmax per 64 weights (double quantization shrinks that further), int8
stores one byte per weight plus per-row scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_chat.errors import DeviceError

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
_LINEAR_BYTES = {"none": None, "8bit": 1.0 + 4 / 4096, "4bit": 0.5 + 4 / 64}
OVERHEAD = 1.15  # activations, CUDA context and allocator slack on top of weights + KV


@dataclass(frozen=True)
class Footprint:
    linear_params: int
    other_params: int
    layers: int
    kv_heads: int
    head_dim: int

    def weight_bytes(self, dtype: torch.dtype, quantize: str = "none") -> int:
        per = _DTYPE_BYTES[dtype]
        linear = _LINEAR_BYTES[quantize] or per
        return int(self.linear_params * linear + self.other_params * per)

    def kv_bytes(self, tokens: int, dtype: torch.dtype, batch: int = 1) -> int:
        """Keys and values for `tokens` per row in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * tokens * batch * _DTYPE_BYTES[dtype]

    def total_bytes(self, dtype: torch.dtype, quantize: str, kv_tokens: int, batch: int = 1) -> int:
        return int(OVERHEAD * (self.weight_bytes(dtype, quantize) + self.kv_bytes(kv_tokens, dtype, batch)))


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
    return Footprint(linear_params=linear, other_params=total - linear, **_kv_shape(config))


def _kv_shape(config) -> dict[str, int]:
    text = config.get_text_config()
    heads = text.num_attention_heads
    return {
        "layers": text.num_hidden_layers,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
    }


def gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


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
    need = fp.total_bytes(dtype, quantize, kv_tokens, rows)
    if need <= free_bytes:
        return
    options = []
    for q in ("4bit", "8bit", "none") if gpu else ():
        if q != quantize and fp.total_bytes(dtype, q, kv_tokens, rows) <= free_bytes:
            options.append(f"--quantize {q} needs ~{gb(fp.total_bytes(dtype, q, kv_tokens, rows))}")
    weights_only = fp.total_bytes(dtype, quantize, 0)
    if weights_only <= free_bytes:  # the weights fit: a smaller budget would
        per_token = fp.kv_bytes(1, dtype, rows) * OVERHEAD
        budget = int((free_bytes - weights_only) / per_token)
        if budget >= 64:
            options.append(f"--budget {budget} fits" + (f" with {rows} rows (--batch-size)" if rows > 1 else ""))
    where = "on this GPU" if gpu else "in this machine's memory"
    hint = "; ".join(options) if options else f"no setting fits {where}: try a smaller model"
    cache = f"a {kv_tokens}-token KV cache" + (f" for each of {rows} rows" if rows > 1 else "")
    has = f"the GPU has {gb(free_bytes)} free" if gpu else f"this machine has {gb(free_bytes)} of memory available"
    raise DeviceError(
        f"{name} with {str(dtype).removeprefix('torch.')} weights (quantize {quantize}) and {cache} "
        f"needs ~{gb(need)}, but {has}; {hint}"
    )


def check_fits_in_memory(name: str, config, dtype: torch.dtype, kv_tokens: int, rows: int = 1) -> None:
    """On CPU: the KV cache is allocated whole at the first token, so a budget beyond this machine's memory
    fails there with "can't allocate"; say before loading which budget would fit."""
    available = available_memory()
    shape = _kv_shape(config)
    kv = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * kv_tokens * rows * _DTYPE_BYTES[dtype]
    if OVERHEAD * kv < available / 4:  # far from the limit: no need to count the parameters
        return
    check_fits(name, footprint(config), dtype, "none", kv_tokens, available, rows=rows, gpu=False)


def check_budget(
    config, dtype: torch.dtype, device: torch.device, kv_tokens: int, rows: int = 1, flag: str = "--budget"
) -> None:
    """With the weights already loaded (a budget changed in the chat, a batch line's own budget): the same
    check as before loading, for the KV cache alone against what is free now -- raise a DeviceError saying
    which `flag` value would fit when a cache of `kv_tokens` for each of `rows` rows would not."""
    fp = Footprint(linear_params=0, other_params=0, **_kv_shape(config))
    gpu = device.type == "cuda"
    free = free_gpu_bytes() if gpu else available_memory()
    need = fp.total_bytes(dtype, "none", kv_tokens, rows)
    if need <= free:
        return
    fits = int(free / (OVERHEAD * fp.kv_bytes(1, dtype, rows)))
    has = f"the GPU has {gb(free)} free" if gpu else f"this machine has {gb(free)} of memory available"
    cache = f"a {kv_tokens}-token KV cache" + (f" for each of {rows} rows" if rows > 1 else "")
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


def free_gpu_bytes() -> int:
    """Free memory over all visible GPUs (accelerate's device_map spreads layers across them)."""
    return sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
