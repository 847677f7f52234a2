"""8-bit storage of the held keys and values (`--kv-quant 8bit`): twice the tokens of a 16-bit cache in the same
bytes (four times a 32-bit one's).

Each token's key (and value) of each KV head is stored as int8 with one scale, the largest magnitude over its
channels / 127 (symmetric, per token and head, like llama.cpp's q8_0 over a whole head). Keys are quantized as
stored, that is rotated. One scale per token keeps attention a plain product: a step's logits are
(q . k_int8) x scale_k, its output (probabilities x scale_v) @ v_int8, so the stored tokens are never rebuilt in
the model's dtype for a decode step; only their int8 values are read and widened in the product.

Measured before it was built (`eval ppl`, alice.txt, 2,048 tokens, recall at 19% of the tokens): emulated
8-bit per token keeps perplexity within 0.1% of the unquantized cache; 4 bits the same way lose 19-22%, so
only 8 is offered (KIVI's 2-bit keys need per-channel groups, which a decode step's single token lacks).
"""

from __future__ import annotations

import torch

MODES = ("none", "8bit")  # --kv-quant: none = the model's dtype (as computed), 8bit = int8 with a per-token scale
QMAX = 127
SCALE_DTYPE = torch.float16  # 2 bytes per token and head beside its D bytes
_TINY = 2.0**-24  # the smallest positive float16: an all-zero token keeps a usable scale


def check_mode(mode: str) -> str:
    """The one check of a --kv-quant value."""
    from h2o_chat.errors import SettingError

    if mode not in MODES:
        raise SettingError("kv_quant", f"must be {' or '.join(MODES)}", mode)
    return mode


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) -> int8 (..., D) and its scale (..., 1) in float16, so that x ~= q * scale. Nine operations: it
    runs for every layer of every decode step (on CPU each costs microseconds)."""
    scale = (x.abs().amax(-1, keepdim=True) / QMAX).clamp_(min=_TINY).to(SCALE_DTYPE)
    q = (x / scale).round_().clamp_(-QMAX, QMAX).to(torch.int8)  # divided by the stored (rounded) scale
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 (..., D) and scale (..., 1) -> (..., D) in `dtype`."""
    return q.to(dtype) * scale.to(dtype)


def bytes_per_element(mode: str, dtype: torch.dtype, head_dim: int) -> float:
    """Stored bytes per key or value element: the dtype's, or 8-bit's plus its share of the scale."""
    if mode == "none":
        return torch.empty(0, dtype=dtype).element_size()
    return 1 + torch.empty(0, dtype=SCALE_DTYPE).element_size() / head_dim
