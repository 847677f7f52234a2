"""The model's rotary embedding, re-applied by the cache when it renumbers positions.

Keys are stored as the model rotated them. Renumbering a held token from the position its key was rotated at
to a new one rotates the key by the difference (rotations compose: R(a) R(b) = R(a + b)), in fp32. Same
convention as transformers' `rotate_half` (LLaMA, Mistral, Qwen2, GPT-NeoX with partial rotary dims).

Only rotary embeddings the cache can reproduce exactly are accepted: one per model, with fixed inverse
frequencies ("default", "linear", "llama3", "yarn" -- its cos/sin scale multiplies both positions alike and
cancels in a difference -- and "dynamic" below its original length, where renumbering keeps it). Anything else
(two embeddings as in Gemma-3, "longrope") is refused with the reason.
"""

from __future__ import annotations

import torch

# rope types whose rotation at a position depends only on fixed inverse frequencies (and a cos/sin scale)
_STATIC_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


class RopeUnsupported(Exception):
    """The model's rotary embedding cannot be re-applied by the cache; the message says why."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """Rotations by integer position differences, from the model's inverse frequencies."""

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        self.inv_freq = inv_freq.detach().float()  # (dims/2,)
        self.scale = float(scale)  # yarn multiplies cos and sin by an attention factor (not re-applied here)
        self.dims = 2 * self.inv_freq.numel()  # rotated head dims (the rest pass through: partial rotary)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> Rope | None:
        """The model's rotary embedding, or None for models without RoPE (OPT). Raises RopeUnsupported when
        the model has one the cache cannot reproduce."""
        found = []
        for name, module in model.named_modules():
            inv_freq = getattr(module, "inv_freq", None)
            rotary = name.endswith("rotary_emb") or "Rotary" in type(module).__name__
            if isinstance(inv_freq, torch.Tensor) and rotary:
                found.append((name, module))
        if not found:
            return None
        distinct = {tuple(getattr(m, "original_inv_freq", m.inv_freq).float().tolist()) for _, m in found}
        if len(distinct) > 1:
            names = ", ".join(n for n, _ in found)
            raise RopeUnsupported(f"it has {len(found)} different rotary embeddings ({names})")
        _, module = found[0]
        rope_type = getattr(module, "rope_type", "default")
        if rope_type not in _STATIC_TYPES:
            raise RopeUnsupported(f"its {rope_type!r} rotary scaling depends on the sequence length")
        inv_freq = getattr(module, "original_inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            inv_freq = module.inv_freq
        return cls(inv_freq, getattr(module, "attention_scaling", 1.0) or 1.0)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (..., dims/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., N, D) rotated as the model rotates at integer positions (..., N), its scale included."""
        cos, sin = self._angles(positions)
        return self._apply(x, cos * self.scale, sin * self.scale)

    def rotate_by(self, x: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        """x (..., N, D), already rotated, moved by `change` (..., N) positions; computed in fp32."""
        cos, sin = self._angles(change)
        return self._apply(x.float(), cos, sin).to(x.dtype)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.dims == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        head, tail = x[..., : self.dims], x[..., self.dims :]
        return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)
