"""Weight-only int4 / int8 linears for CPU: the bytes a decode step reads, cut 8x / 4x from float32.

A CPU decode step is a matrix-vector product per linear, bound by the bytes of the weights it reads (the
embedded model's 540 MB of float32 per token). PyTorch ships the kernels that read packed weights:

- int4: `aten._weight_int4pack_mm_for_cpu`, groups of 32 input channels, each with a scale and a zero
  (w = (q - 8) * scale + zero, q in 0..15). GGUF's Q4_1 blocks (w = q * d + m, 32 values) are exactly this
  form (scale = d, zero = m + 8 d) and Q4_0 (w = (q - 8) d) too (zero = 0): a GGUF model runs from its own
  4-bit values, only the scales rounded to bfloat16.
- int8: `aten._weight_int8pack_mm`, one scale per output channel. Used for the embedding / LM head, which the
  GGUF stores as Q8_0 (a scale per 32 values) and which is re-scaled per row: one int8 table serves the input
  embedding (a row gather) and the tied LM head (the product).

A decode step's bytes are what it costs (the step runs at the processor's cache bandwidth), and the LM head is
the largest single read (the embedded model's int8 table: 28 MB of a step's ~118). With 4-bit weights the head
reads a 4-bit copy of its table (14 MB + scales) for its products, then recomputes each row's
`REFINED_AFTER_4BIT` best outputs exactly from the int8 table (`Int8Linear._refine`): the logits that decide a
greedy or sampled token are the int8 table's, the rest carry 4-bit error.

Both kernels are fast only with bfloat16 activations (their float32 paths are 10-30x slower), so a packed
linear takes its input in bfloat16 and returns the model's dtype.

A prompt chunk is a matrix product, not a matrix-vector one: there the packed kernels are no faster than a
dense product, so a chunk of `DENSE_TOKENS` tokens per row or more dequantizes the weight (in blocks of output
channels, kept in the processor's cache) and multiplies densely in bfloat16. The choice depends on the tokens
per row, never on the batch: a row computes the same way alone and beside others.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

GROUP = 32  # input channels per int4 scale/zero (GGUF's block size)
COMPUTE = torch.bfloat16  # what the packed kernels are fast with
DENSE_TOKENS = 16  # a forward of this many tokens per row or more multiplies densely (a prompt chunk)
DENSE_BLOCK = 2048  # output channels dequantized at a time by the dense path (bounds its transient)
REFINED = 16  # LM-head outputs per row recomputed in float32 from the int8 table (`Int8Linear._refine`)
# ... when the product went through the head's 4-bit copy: perplexity over 1,024 tokens of alice.txt (full cache)
# 1.8% above the int8 head's with 16 refined, 1.0% with 64, 0.47% with 256 (the 4-bit error of the many tokens
# below the top still weighs in the softmax's sum); a sampler's candidates (40) are well inside
REFINED_AFTER_4BIT = 256


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) uint8, two to a byte in plain order (even index low)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` undone: (N, K / 2) uint8 -> (N, K) uint8."""
    return torch.stack((nib & 15, nib >> 4), dim=-1).view(nib.shape[0], -1)


def _int4_pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int values 0..15 -> the CPU kernel's packed layout (N, K / 2) uint8."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


class Int4Linear(nn.Module):
    """y = x W^T + b with W (N, K) held as 4-bit values in groups of `GROUP` along K."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None = None,
        dense: bool = True,
    ):
        # q (N, K) in 0..15; scale, zero (N, K / GROUP): w = (q - 8) * scale + zero. `dense`: keep the nibbles
        # in plain order for prompt chunks (`_dense`); without them only `matvec` works
        super().__init__()
        N, K = q.shape
        if K % GROUP:
            raise ValueError(f"int4 weights need input channels in multiples of {GROUP}, got {K}")
        self.in_features, self.out_features = K, N
        self.register_buffer("packed", _int4_pack(q))  # (N, K / 2) uint8
        sz = torch.stack((scale.float().t(), zero.float().t()), dim=-1)  # (K / GROUP, N, 2)
        self.register_buffer("scales_zeros", sz.to(COMPUTE).contiguous())
        # the nibbles as (N, K / 2) uint8 in plain order, for the dense path: the kernel's packing is its own
        self.register_buffer("nibbles", pack_nibbles(q) if dense else None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dense: bool = True) -> Int4Linear:
        """Asymmetric 4-bit per group of 32 (min/max, as GGUF's Q4_1)."""
        w = weight.detach().float()
        N, K = w.shape
        g = w.view(N, K // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).view(N, K)
        return cls(q.to(torch.uint8), scale, lo + 8 * scale, bias, dense)

    @classmethod
    def join(cls, parts: list[Int4Linear]) -> Int4Linear:
        """One linear whose outputs are the parts' outputs, in order (the same values, scales and zeros)."""
        q = torch.cat([unpack_nibbles(p.nibbles) for p in parts])
        sz = torch.cat([p.scales_zeros.float() for p in parts], dim=1)  # (K / G, N, 2); bfloat16 exactly
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])
        return cls(q, sz[..., 0].t(), sz[..., 1].t(), bias)

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (N, K) as the kernel sees it (its bfloat16 scales and zeros, float32 arithmetic) for output channels
        `rows`, in `dtype`."""
        nib = self.nibbles[rows]
        q = unpack_nibbles(nib).view(nib.shape[0], -1, GROUP).float()  # (n, K/G, G)
        sz = self.scales_zeros[:, rows].float()  # (K / G, n, 2)
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        return torch.addcmul(zero, q - 8, scale).reshape(nib.shape[0], -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if (shape[-2] if x.dim() > 2 else 1) >= DENSE_TOKENS:
            y = self._dense(x.reshape(-1, shape[-2], self.in_features).to(COMPUTE))
        else:
            y = self.matvec(x.reshape(-1, self.in_features))
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) bfloat16 through the packed kernel, bias not added."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(COMPUTE), self.packed, GROUP, self.scales_zeros)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, K) -> (B, T, N) through the dequantized weight, in blocks of output channels. One product per
        row: a dense kernel's rounding depends on how many rows it is given, and a row must compute alike alone
        and in a batch."""
        B, T, _ = x.shape
        y = x.new_empty(B, T, self.out_features)
        for n in range(0, self.out_features, DENSE_BLOCK):
            w = self.dequantize(slice(n, n + DENSE_BLOCK), x.dtype).t()  # (K, n)
            for b in range(B):
                torch.mm(x[b], w, out=y[b, :, n : n + DENSE_BLOCK])
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}"


class SharedInput(nn.Module):
    """Int4 linears that read the same input, multiplied as one: a layer's q, k and v; its gate and up. A
    decode step's products are small (a vector times 576 x 192 for k), where each kernel call has a fixed cost
    of its own: one call instead of three saves it, and the input is read once. The model's code still calls
    each part (`SharedPart`) in its own order: the first multiplies by the joined table and holds the result,
    the others take their columns of it, and the last lets it go, so that nothing is held between forwards (and
    a compiled step keeps no state of its own). Only for families whose attention and MLP call their parts in
    the order given (`SHARED_INPUTS`): a test runs each against the separate linears."""

    def __init__(self, joined: Int4Linear, sizes: list[int]):
        super().__init__()
        self.joined, self.sizes = joined, sizes
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.pending: list[torch.Tensor] = []


class SharedPart(nn.Module):
    """Part `index` of a `SharedInput` group, in the place of the linear it was."""

    def __init__(self, group: SharedInput, index: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.joined.in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        if self.index == 0:
            g.pending.clear()  # a forward interrupted between the parts left its product: not reused
            g.pending.append(g.joined(x))
        y = g.pending[0]
        if self.index == len(g.sizes) - 1:
            g.pending.clear()
        start = g.starts[self.index]
        return y[..., start : start + self.out_features]

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This part's W (out_features, K), as `Int4Linear.dequantize` gives it."""
        start = self.group.starts[self.index]
        return self.group.joined.dequantize(slice(start, start + self.out_features), dtype)[rows]

    def extra_repr(self) -> str:
        return f"part {self.index} of {self.group.joined.out_features} columns: {self.out_features}"


# families whose modules call these linears, on the same input, in this order (transformers' llama, mistral and
# qwen2 code: q, k, v in attention; gate, then up, in the MLP)
SHARED_INPUTS = {
    ("llama", "mistral", "qwen2"): (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
}


def share_inputs(model: nn.Module) -> None:
    """Join the int4 linears that read one input (`SharedInput`) where the family is known to call them in
    order."""
    names = next((n for fams, n in SHARED_INPUTS.items() if model.config.model_type in fams), ())
    for module in list(model.modules()):
        for group in names:
            parts = [getattr(module, n, None) for n in group]
            if not all(isinstance(p, Int4Linear) and p.nibbles is not None for p in parts):
                continue
            if len({p.in_features for p in parts}) != 1:
                continue
            shared = SharedInput(Int4Linear.join(parts), [p.out_features for p in parts])
            for i, n in enumerate(group):
                setattr(module, n, SharedPart(shared, i))


class Int8Linear(nn.Module):
    """y = x W^T + b with W (N, K) held as int8 with one scale per output channel. Also an embedding table:
    `embed(ids)` gathers rows (a tied embedding / LM head holds one table)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q.to(torch.int8).contiguous())  # (N, K)
        self.register_buffer("scales", scale.float().to(COMPUTE).contiguous())  # (N,)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.refine_top = 0  # the LM head: its best outputs per row recomputed in float32 (`_refine`)
        self.fast: Int4Linear | None = None  # the LM head: a 4-bit copy for its products (`use_4bit_products`)

    def use_4bit_products(self) -> None:
        """Multiply through a 4-bit copy of the table, half the bytes of a decode step's largest read; the best
        outputs are then recomputed from this int8 table. Every product goes this way (a prompt's logits too, no
        slower there): a full cache's perplexity, computed from a prompt's logits, is then that of the same head
        as a decode step's."""
        self.refine_top = REFINED_AFTER_4BIT
        self.fast = Int4Linear.from_float(self.dequantize(), dense=False)

    def _refine(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The kernel returns bfloat16: logits near the top share values (17.375 for two tokens), so greedy
        decoding chose among ties by index and top-k 1 among them at random. Each row's `refine_top` best outputs
        are recomputed from the float32 input and the int8 weights (those within bfloat16's error of the best are
        a handful): y in place. Fixed shapes, no host read: it compiles into the decode step."""
        cols = y.topk(min(self.refine_top, y.shape[-1]), dim=-1).indices  # (M, k)
        w = self.weight_int8[cols].float() * self.scales[cols][..., None].float()  # (M, k, K)
        exact = (w * x[:, None, :].float()).sum(-1)
        if self.bias is not None:
            exact += self.bias[cols].float()
        y.scatter_(-1, cols, exact.to(y.dtype))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric int8 per output channel."""
        w = weight.detach().float()
        scale = (w.abs().amax(-1) / 127).clamp(min=1e-10)
        return cls((w / scale[:, None]).round_().clamp_(-127, 127), scale, bias)

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight_int8[rows].float() * self.scales[rows, None].float()).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.fast is not None:  # every product, a prompt's too: evaluation measures what decoding uses
            y = self.fast.matvec(x2)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(COMPUTE), self.weight_int8, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if self.refine_top:
            self._refine(x2, y)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int8Embedding(nn.Module):
    """An embedding that reads its rows from an `Int8Linear`'s table (the tied LM head's, or its own)."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        self.table, self.dtype, self.padding_idx = table, dtype, padding_idx
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The table dequantized (for code that reads an embedding's weight: its dtype and device, mostly)."""
        return self.table.dequantize().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        return t.weight_int8[ids].to(self.dtype) * t.scales[ids, None].to(self.dtype)


# -- GGUF blocks -> the kernels' forms --------------------------------------------------------------------
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


def save_blocks(blocks: dict, path) -> None:
    """`gguf_int4_blocks`' result as safetensors (nibbles two to a byte), written whole or not at all."""
    import os
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    tensors = {}
    for name, (q, scale, zero) in blocks.items():
        tensors |= {f"{name}.q": pack_nibbles(q), f"{name}.scale": scale.contiguous()}
        tensors[f"{name}.zero"] = zero.contiguous()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_blocks(path) -> dict:
    """What `save_blocks` wrote: {module name: (q (N, K) uint8, scale, zero)}; {} for an unreadable file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError):
        return {}
    out = {}
    for key in tensors:
        if key.endswith(".q"):
            name = key[:-2]
            out[name] = (unpack_nibbles(tensors[key]), tensors[f"{name}.scale"], tensors[f"{name}.zero"])
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: parameters and the packed linears' buffers (the dense path's nibbles
    included), each tensor once (a tied table counts once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen or t.is_floating_point() and t.dim() < 1:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def quantize_model(model: nn.Module, fmt: str, int4_blocks: dict | None = None) -> None:
    """Replace the model's linears in place with packed ones (`fmt` "4bit": int4 groups of 32, "8bit": int8 per
    channel), the embedding and the LM head with one int8 table (shared when they are tied). `int4_blocks`
    (`gguf_int4_blocks`): linears whose file holds 4-bit values, taken as they are."""
    int4_blocks = int4_blocks or {}
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or child is head:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if full in int4_blocks and fmt == "4bit":
                new = Int4Linear(*int4_blocks[full], bias=child.bias)
            elif fmt == "4bit" and child.in_features % GROUP == 0:
                new = Int4Linear.from_float(child.weight, child.bias)
            else:
                new = Int8Linear.from_float(child.weight, child.bias)
            setattr(module, child_name, new)
    dtype = embed.weight.dtype
    if head is not None:
        table = Int8Linear.from_float(head.weight, head.bias)
        if fmt == "4bit":
            table.use_4bit_products()
        else:
            table.refine_top = REFINED
        model.set_output_embeddings(table)
        if tied:
            model.set_input_embeddings(Int8Embedding(table, dtype, getattr(embed, "padding_idx", None)))
    if not tied and embed is not None:
        model.set_input_embeddings(
            Int8Embedding(Int8Linear.from_float(embed.weight), dtype, getattr(embed, "padding_idx", None))
        )
    if fmt == "4bit":
        share_inputs(model)
