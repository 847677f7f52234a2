"""Rotary position embedding applied by the cache, for `--positions rolling`.

In rolling mode the model is given position 0 for every token, so its own rotary embedding is the identity
and the cache receives un-rotated queries and keys. The cache then rotates them by their rank among the
tokens it holds (StreamingLLM's "positions within the cache"): however long generation runs, positions stay
below budget + chunk, inside the trained context. Same convention as transformers' `rotate_half` (LLaMA,
Mistral, Qwen2, GPT-NeoX with partial rotary dims).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """Rotations by integer positions, from the model's inverse frequencies."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().float()  # (dims/2,)
        self.dims = 2 * self.inv_freq.numel()  # rotated head dims (the rest pass through: partial rotary)
        self._cos = self._sin = None  # table for small positions: rolling ranks stay below budget + chunk

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> Rope | None:
        """The model's rotary inverse frequencies, or None for models without RoPE (OPT)."""
        for name, module in model.named_modules():
            inv_freq = getattr(module, "inv_freq", None)
            if name.endswith("rotary_emb") and isinstance(inv_freq, torch.Tensor):
                return cls(inv_freq)
        return None

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (..., dims/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _table(self, upto: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < upto or self._cos.device != device:
            size = max(upto, 2 * (self._cos.shape[0] if self._cos is not None else 512))
            self._cos, self._sin = self._angles(torch.arange(size, device=device))
        return self._cos, self._sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, small: int | None = None) -> torch.Tensor:
        """x (..., N, D) rotated by integer positions (..., N). `small` (an upper bound on the positions)
        lets rolling ranks use a precomputed table instead of trigonometry each step."""
        if small is not None:
            cos, sin = self._table(small, x.device)
            cos, sin = cos[positions], sin[positions]  # (..., N, dims)
        else:
            cos, sin = self._angles(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.dims == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        head, tail = x[..., : self.dims], x[..., self.dims :]
        return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)
