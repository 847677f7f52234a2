"""Will it fit? Weights and KV cache sizes from a config, checked against free GPU memory before loading.

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
    text = config.get_text_config()
    heads = text.num_attention_heads
    return Footprint(
        linear_params=linear,
        other_params=total - linear,
        layers=text.num_hidden_layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
    )


def gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


def check_fits(
    name: str,
    fp: Footprint,
    dtype: torch.dtype,
    quantize: str,
    kv_tokens: int,
    free_bytes: int,
) -> None:
    """Raise a DeviceError saying what would fit when the model does not."""
    need = fp.total_bytes(dtype, quantize, kv_tokens)
    if need <= free_bytes:
        return
    options = []
    for q in ("4bit", "8bit", "none"):
        if q != quantize and fp.total_bytes(dtype, q, kv_tokens) <= free_bytes:
            options.append(f"--quantize {q} needs ~{gb(fp.total_bytes(dtype, q, kv_tokens))}")
    weights_only = fp.total_bytes(dtype, quantize, 0)
    if weights_only <= free_bytes:  # the weights fit: a smaller budget would
        per_token = fp.kv_bytes(1, dtype) * OVERHEAD
        budget = int((free_bytes - weights_only) / per_token)
        if budget >= 64:
            options.append(f"--budget {budget} fits")
    hint = "; ".join(options) if options else "no setting fits on this GPU: try a smaller model"
    raise DeviceError(
        f"{name} with {str(dtype).removeprefix('torch.')} weights (quantize {quantize}) and a {kv_tokens}-token "
        f"KV cache needs ~{gb(need)}, but the GPU has {gb(free_bytes)} free; {hint}"
    )


def free_gpu_bytes() -> int:
    """Free memory over all visible GPUs (accelerate's device_map spreads layers across them)."""
    return sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
