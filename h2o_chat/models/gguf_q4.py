"""A GGUF file's 4-bit linears as the int4 kernel takes them: GGUF's Q4_1 blocks (w = q * d + m, 32 values) are
the kernel's form (scale = d, zero = m + 8 d, w = (q - 8) * scale + zero) and Q4_0 (w = (q - 8) d) too (zero = 0),
so a GGUF model runs from its own 4-bit values, only the scales rounded to bfloat16 (`cpu_quant.Int4Linear`)."""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32  # values per GGUF block (the int4 kernel's group, `cpu_quant.GROUP`)


def gguf_q4(kind: str, data: np.ndarray, shape: tuple[int, int]):
    """A GGUF Q4_0 / Q4_1 tensor's raw blocks (N, K / 32 * block bytes) -> (q (N, K) uint8 0..15, scale, zero
    (N, K / 32) float32) with w = (q - 8) * scale + zero, exactly the file's values."""
    N, K = shape
    head = 4 if kind == "Q4_1" else 2  # d (and m) as float16, then 16 bytes of nibbles
    blocks = np.ascontiguousarray(data).reshape(N, K // GROUP, head + 16)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    qs = blocks[..., head:]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(N, K)  # x[j] low nibble, x[j + 16] high
    zero = m + 8 * d if m is not None else np.zeros_like(d)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero)


def _unpermute_rows(n_rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a llama GGUF's q/k weights (llama.cpp stores them permuted for its
    rotary layout): rows[i] is the file's row that becomes row i."""
    dim = n_rows // heads // 2
    return torch.arange(n_rows).view(heads, dim, 2).transpose(1, 2).reshape(n_rows)


_LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def gguf_int4_blocks(path, config) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A llama-family GGUF's Q4_0 / Q4_1 linears as {module name: (q, scale, zero)} in the converted model's row
    order; empty for other architectures (their linears are quantized from the converted floats)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"]
    if bytes(arch.parts[arch.data[0]]).decode() not in ("llama", "mistral"):
        return {}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.{i}.{kind}.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LLAMA_NAMES:
            continue
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1"):
            continue
        K, N = (int(x) for x in t.shape)  # GGUF lists the fastest dimension first
        q, scale, zero = gguf_q4(kind, t.data, (N, K))
        if parts[2] in ("attn_q", "attn_k"):
            rows = _unpermute_rows(N, heads if parts[2] == "attn_q" else kv_heads)
            q, scale, zero = q[rows], scale[rows], zero[rows]
        out[f"model.layers.{parts[1]}.{_LLAMA_NAMES[parts[2]]}"] = (q, scale, zero)
    return out
