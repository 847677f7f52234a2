"""Recall's store outside any step: the basis its ranking reads fitted to the stored and held keys, its keys
renumbered when their rows' positions are, and how often each position was recalled read back. `Store` takes
these from `StoreUpkeep`; none runs inside a captured or compiled step."""

from __future__ import annotations

import torch

from h2o_chat.engine.storage.quant import dequantize, quantize


class StoreUpkeep:
    """The host-side upkeep of a `Store` (which declares these tensors and host lists)."""

    keys: torch.Tensor
    kscale: torch.Tensor
    low: torch.Tensor
    lscale: torch.Tensor
    basis: torch.Tensor
    pos: torch.Tensor
    rot: torch.Tensor
    marks: torch.Tensor
    capacity: int
    batch: int
    evicted: list[int]
    fitted: list[int]
    _reported: tuple[torch.Tensor, torch.Tensor] | None

    @torch.inference_mode()
    def fit(self, rows: list[int], slots) -> None:
        """Fit the basis of `rows` -- per layer and KV head, the top eigenvectors of the uncentred second moment
        of the row's held keys (in `slots`) and stored keys -- and write every stored key's coordinates in it. In
        place (a captured step keeps reading the same memory); one layer at a time."""
        r, c = self.low.shape[-1], self.capacity
        index = torch.tensor(rows, device=self.keys.device)
        n = slots.capacity

        def stored_keys(i: int) -> torch.Tensor:
            mine = (self.keys[i, :, :, :c].index_select(0, index), self.kscale[i, :, :, :c].index_select(0, index))
            stored = dequantize(*mine, torch.float32)
            return stored * (self.pos[i, :, :, :c].index_select(0, index) >= 0)[..., None]

        grams = []
        for i in range(self.keys.shape[0]):
            stored = stored_keys(i)
            held = slots.read("keys", (i, slice(None), slice(None), slice(0, n))).index_select(0, index).float()
            held = held * (slots.pos[i, :, :, :n].index_select(0, index) >= 0)[..., None]
            grams.append(stored.mT @ stored + held.mT @ held)  # (b, H, D, D)
        # every layer's eigenvectors in one call, on the host: CUDA's eigh of matrices this size solves one matrix
        # at a time, each with a host synchronisation (32 layers x 32 heads per fit for Llama-2-7B)
        gram = torch.stack(grams)
        vectors = torch.linalg.eigh(gram.cpu()).eigenvectors.to(gram.device)  # eigenvalues ascend
        bases = vectors[..., -r:].contiguous()
        for i in range(self.keys.shape[0]):  # dequantized again: every layer's at once would be the store in fp32
            self.basis[i, index] = bases[i]
            low, lscale = quantize(stored_keys(i) @ bases[i])
            self.low[i, index, :, :c], self.lscale[i, index, :, :c] = low, lscale
        for row in rows:
            self.fitted[row] = max(1, self.evicted[row])

    @torch.inference_mode()
    def renumber(self, rows: list[int], held: torch.Tensor, rope) -> None:
        """Rows `rows` just had their held tokens numbered by their order (`positions.Numbering.renumber`;
        `held` (L, B, H, S) their true positions, -1 for an empty slot). Each stored token of those rows is
        numbered where it stands among them -- the count of held tokens with a smaller true position -- and its
        key rotated by the change. Their coordinates are fitted again at the next forward."""
        selected = torch.zeros(self.batch, dtype=torch.bool, device=self.pos.device)
        selected[torch.as_tensor(rows, device=self.pos.device)] = True
        chosen = selected[:, None, None]
        big = torch.iinfo(torch.long).max
        n = self.capacity
        for i in range(self.keys.shape[0]):
            order = torch.where(held[i] >= 0, held[i], big).sort(-1).values  # (B, H, S)
            pos, rot = self.pos[i, :, :, :n].long(), self.rot[i, :, :, :n]
            rank = torch.searchsorted(order, pos.contiguous())
            move = chosen & (pos >= 0)
            change = torch.where(move, rank - rot.long(), 0)
            keys = dequantize(self.keys[i, :, :, :n], self.kscale[i, :, :, :n], torch.float32)
            self.keys[i, :, :, :n], self.kscale[i, :, :, :n] = quantize(rope.rotate_by(keys, change))
            rot.copy_(torch.where(move, rank, rot.long()).to(rot.dtype))
        for r in rows:
            self.fitted[r] = 0  # the rotated keys' coordinates: fitted again before the next forward

    @torch.inference_mode()
    def take_counts(self) -> torch.Tensor:
        """How often each true position was recalled (by any layer, head and step) since the last call, per row:
        (B, positions) float over [0, max position recalled] (empty when nothing was). The marks themselves are
        kept (the `recalls` drop rule ranks by them): what is new is what an entry holding the same position had
        then."""
        n = self.capacity
        marks, pos = self.marks[..., :n].cpu(), self.pos[..., :n].cpu().long()
        before = self._reported
        self._reported = (marks.clone(), pos.clone())
        if before is not None and before[0].shape == marks.shape:
            marks = marks - torch.where(before[1] == pos, before[0], 0)
        counts = marks.masked_fill(pos < 0, 0).clamp(min=0)
        hit = counts > 0
        if not bool(hit.any()):
            return torch.zeros(self.batch, 0)
        out = torch.zeros(self.batch, int(pos[hit].max()) + 1)
        rows = torch.arange(self.batch)[None, :, None, None].expand_as(counts)
        out.index_put_((rows[hit], pos[hit]), counts[hit].float(), accumulate=True)
        return out
