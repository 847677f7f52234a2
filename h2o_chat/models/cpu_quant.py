"""Weight-only int4 / int8 linears for CPU: the bytes a decode step reads, cut 8x / 4x from float32.

A CPU decode step is a matrix-vector product per linear, bound by the bytes of the weights it reads (the
embedded model's 540 MB of float32 per token). PyTorch ships the kernels that read packed weights:

- int4: `aten._weight_int4pack_mm_for_cpu`, groups of 32 input channels, each with a scale and a zero
  (w = (q - 8) * scale + zero, q in 0..15): GGUF's Q4_0 / Q4_1 blocks are this form (`gguf_q4.py`).
- int8: `aten._weight_int8pack_mm`, one scale per output channel. Used for the embedding / LM head, which the
  GGUF stores as Q8_0 (a scale per 32 values) and which is re-scaled per row: one int8 table serves the input
  embedding (a row gather) and the tied LM head (the product).

Both kernels are fast only with bfloat16 activations (their float32 paths are 10-30x slower), so a packed
linear takes its input in bfloat16 and returns the model's dtype.

Every product of an int4 linear goes through one of two kernels, and a row's result never depends on the other
rows, so a row decodes bit for bit the same alone and in a batch, and a batch of prompts reads as each alone:
- PyTorch's kernel: each output one float32 multiply-add chain over the input channels, in order. Its time grows
  with the rows: 8 rows cost ~3.5x one, a prompt chunk of 512 ~150x.
- where the CPU has AMX, our library's (`native`; `H2O_CHAT_NATIVE=0` turns it off, `=chunks` keeps it for prompt
  chunks only), which every product of the process then takes: decode steps through `int4_mv` (exact products per
  group: as fast as PyTorch's for one row, ~3x faster for 8), prompt chunks through `int4_mm` (`prompt_products`:
  the weights rounded to bfloat16 before their exact products, 7-9x faster for a chunk of 512). Where the CPU has
  AVX2 and FMA but no AMX, the library's AVX2 build: one product for prompt chunks and decode steps, llama.cpp's
  Q4 x Q8 with the largest x of each group of 32 kept as it is (~2x PyTorch's for a chunk of 37 rows or more, as its
  float32 predecessor; ~1.5x faster than that for one row and for 8; perplexity unchanged).
A token read in a chunk differs from the same token decoded by a step in the last bits, as it already did through
the attention's products: a conversation continued from its cache and the same one read fresh agreed on 9 of 12
greedy second replies with either chunk kernel (`scripts/int4_amx/continuity.py`). A dense bfloat16 product rounds
each row differently with the number of rows it is given. The weights are held once, in PyTorch's layout
(`Int4Linear.values` reads them back through its kernel), which all the kernels read.

The LM head reads a 4-bit copy of its int8 table for its products (`Int8Linear.use_4bit_products`): a decode
step's largest read halved. Its error is not only noise: a softmax over ~49k noisy logits is biased (the noise's
exponentials sum high, and a likely token that falls below the recomputed best ones does so because its noise
was negative): +0.7-0.9% perplexity on texts it was not tuned on. Most of the noise comes from a few input
channels (the final hidden state's largest; 64 of 576 carry ~75% of it): their products come from the int8
table's columns, beside the copy made without them, and each row's best outputs are recomputed exactly from the
table.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from h2o_chat.models import native

GROUP = 32  # input channels per int4 scale/zero (GGUF's block size)
COMPUTE = torch.bfloat16  # what the packed kernels are fast with
REFINED = 16  # LM-head outputs per row recomputed in float32 from the int8 table (`Int8Linear._refine`)
# ... when the product went through the head's 4-bit copy: perplexity over 1,024 tokens of alice.txt (full cache)
# 1.8% above the int8 head's with 16 refined, 1.0% with 64, 0.47% with 256 (the 4-bit error of the many tokens
# below the top still weighs in the softmax's sum); a sampler's candidates (40) are well inside
REFINED_AFTER_4BIT = 256
# input channels of the LM head multiplied by the int8 table beside its 4-bit copy. The head's own share of
# perplexity (its products against the int8 table's), 4,096 tokens of alice.txt (where the channels are chosen) /
# moby_dick.txt / as_you_like_it.txt: plain copy +0.52 / +0.95 / +0.69%, 64 channels +0.09 / +0.21 / +0.22%
# (standard errors 0.06-0.24); the logits' squared error 0.30 -> 0.06
EXACT_CHANNELS = 64


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (N, K) -> (q (N, K) uint8 0..15, scale, zero (N, K / GROUP)): asymmetric 4-bit per group of 32 (min/max,
    as GGUF's Q4_1), w = (q - 8) * scale + zero."""
    w = weight.detach().float()
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"int4 weights need input channels in multiples of {GROUP}, got {K}")
    g = w.view(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).view(N, K)
    return q.to(torch.uint8), scale, lo + 8 * scale


def exact_channel_count(in_features: int) -> int:
    """Input channels an LM head of `in_features` multiplies by its int8 table beside its 4-bit copy: at most a
    quarter, in whole multiples of 16 (what the int8 kernel takes: it crashed on 8)."""
    return min(EXACT_CHANNELS, in_features // 4) // 16 * 16


def _int4_rounded(weight: torch.Tensor) -> torch.Tensor:
    """W (N, K) float32 as a 4-bit copy of it holds it (`quantize_int4`, scales and zeros in bfloat16)."""
    q, scale, zero = quantize_int4(weight)
    scale, zero = (t.to(COMPUTE).float().repeat_interleave(GROUP, 1) for t in (scale, zero))
    return (q.float() - 8) * scale + zero


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """(M, K) bfloat16 -> (M, N) bfloat16 through the int4 kernel."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)


# the kernel a prompt chunk's 4-bit products go through (`prompt_products`); None: PyTorch's
_chunk_kernel: ContextVar[Callable | None] = ContextVar("chunk_kernel", default=None)


@contextmanager
def prompt_products() -> Iterator[None]:
    """The 4-bit products inside (a prompt chunk's: the engine reads every chunk of a 4-bit model inside this, as
    `model.prompt_products`) go through the AMX kernel for chunks where it is turned on and this machine runs it
    (`native.int4_mm`): a chunk of 512 rows costs 7-9x less than through PyTorch's kernel. Products outside (decode
    steps) go through `native.int4_mv` there."""
    token = _chunk_kernel.set(native.int4_mm())
    try:
        yield
    finally:
        _chunk_kernel.reset(token)


class Int4Linear(nn.Module):
    """y = x W^T + b with W (N, K) held as 4-bit values in groups of `GROUP` along K, in the kernel's layout."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None = None):
        # packed (N, K / 2) uint8: the kernel's layout (`from_values` makes it); scales_zeros (K / GROUP, N, 2)
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], scales_zeros.shape[0] * GROUP
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_values(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """q (N, K) in 0..15; scale, zero (N, K / GROUP): w = (q - 8) * scale + zero (scales kept in bfloat16)."""
        if q.shape[1] % GROUP:
            raise ValueError(f"int4 weights need input channels in multiples of {GROUP}, got {q.shape[1]}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack((scale.float().t(), zero.float().t()), dim=-1).to(COMPUTE).contiguous()
        return cls(packed, sz, None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        return cls.from_values(*quantize_int4(weight), bias)

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool = False) -> Int4Linear:
        """The shapes only (meta tensors), for weights assigned from a saved packed model (`packed.py`)."""
        meta = {"device": "meta"}
        packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, **meta)
        sz = torch.empty(in_features // GROUP, out_features, 2, dtype=COMPUTE, **meta)
        return cls(packed, sz, torch.empty(out_features, **meta) if bias else None)

    def values(self) -> torch.Tensor:
        """The 4-bit values q (N, K) uint8, read back through the kernel itself: with scale 1 and zero 8 it
        returns q exactly, whatever layout this CPU's build of the kernel packed them in."""
        K, N = self.in_features, self.out_features
        unit = torch.tensor([1.0, 8.0], dtype=COMPUTE).expand(K // GROUP, N, 2).contiguous()
        return _int4_mm(torch.eye(K, dtype=COMPUTE), self.packed, unit).t().to(torch.uint8)

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (N, K) as the kernel computes it (its bfloat16 scales and zeros, float32 arithmetic) for output
        channels `rows`, in `dtype`."""
        q = self.values()[rows]
        sz = self.scales_zeros[:, rows].float()  # (K / G, n, 2)
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        w = torch.addcmul(zero, q.view(q.shape[0], -1, GROUP).float() - 8, scale)
        return w.reshape(q.shape[0], -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.matvec(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) bfloat16 through the packed kernel, bias not added: any number of rows, each row's
        result independent of the others. Inside `prompt_products` the chunks' kernel; outside, the steps' one:
        ours where the library is used in this process (decided once), else PyTorch's."""
        x = x.to(COMPUTE).contiguous()
        kernel = _chunk_kernel.get() or native.int4_mv()
        if kernel is not None and x.device.type == "cpu" and self.out_features % native.block() == 0:
            return kernel(x, self.packed, GROUP, self.scales_zeros)
        return _int4_mm(x, self.packed, self.scales_zeros)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}"


# -- linears that read one input, multiplied as one ------------------------------------------------------------
# families whose modules read these linears on the module's own input and nothing else from it (transformers'
# llama, mistral and qwen2 attention and MLP): {joined linear: the linears it replaces, in order}
JOINED = {
    ("llama", "mistral", "qwen2"): {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
}


class Columns(nn.Module):
    """In the place of a linear that its module multiplies joined with its siblings (`join_linears`, as gpt-fast's
    `wqkv`): the module's code is handed the joined product instead of its input, and each former linear takes
    its own columns of it. Stateless, so the module's code may call the parts in any order, and a part given
    anything but the joined product fails loudly instead of computing something else."""

    def __init__(self, start: int, out_features: int, width: int):
        super().__init__()
        self.start, self.out_features, self.width = start, out_features, width

    def forward(self, joined: torch.Tensor) -> torch.Tensor:
        if joined.shape[-1] != self.width:
            raise RuntimeError(
                f"a joined linear's part was called on a tensor of width {joined.shape[-1]}, not its module's "
                f"joined product ({self.width}): this model's code reads its linears differently (`JOINED`)"
            )
        return joined[..., self.start : self.start + self.out_features]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.start + self.out_features} of the joined product ({self.width})"


def _multiply_joined(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a module with a joined linear: its input replaced by the joined product (one kernel
    call for q, k and v), which its `Columns` part."""
    name, arg = module.joined_linear
    joined = getattr(module, name)
    if args:
        return (joined(args[0]), *args[1:]), kwargs
    return args, {**kwargs, arg: joined(kwargs[arg])}


def join_linears(module: nn.Module, name: str, parts: tuple[str, ...], joined: Int4Linear) -> None:
    """Make `joined` (whose outputs are those of `parts`, in order) the one product of `module`'s input."""
    start = 0
    for part in parts:
        size = getattr(module, part).out_features
        setattr(module, part, Columns(start, size, joined.out_features))
        start += size
    if start != joined.out_features:
        raise ValueError(f"{name}: {joined.out_features} outputs for parts of {start}")
    setattr(module, name, joined)
    module.joined_linear = (name, next(iter(inspect.signature(module.forward).parameters)))
    module.register_forward_pre_hook(_multiply_joined, with_kwargs=True)


def _joined_groups(model: nn.Module, module: nn.Module) -> dict[str, tuple[str, ...]]:
    """The groups of `module`'s linears to join: those of the family's `JOINED` that it holds, all reading one
    input (same in_features, a whole number of int4 groups)."""
    groups = next((g for fams, g in JOINED.items() if model.config.model_type in fams), {})
    found = {}
    for name, parts in groups.items():
        linears = [getattr(module, p, None) for p in parts]
        if not all(isinstance(p, nn.Linear) for p in linears):
            continue
        widths = {p.in_features for p in linears}
        if len(widths) == 1 and widths.pop() % GROUP == 0:
            found[name] = parts
    if len(found) > 1:  # the module's one input can be replaced by one joined product only
        raise ValueError(f"{type(module).__name__} holds more than one group of joined linears: {list(found)}")
    return found


# -- int8: the embedding and LM head ---------------------------------------------------------------------------
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
        self.register_buffer("exact_channels", None)  # ... and the input channels it leaves to this table
        self.register_buffer("exact_columns", None)

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool = False) -> Int8Linear:
        """The shapes only (meta tensors), for weights assigned from a saved packed model (`packed.py`)."""
        q = torch.empty(out_features, in_features, dtype=torch.int8, device="meta")
        scale = torch.empty(out_features, dtype=COMPUTE, device="meta")
        return cls(q, scale, torch.empty(out_features, device="meta") if bias else None)

    def use_4bit_products(self, inputs: torch.Tensor | None = None, empty: bool = False) -> None:
        """Multiply through a 4-bit copy of the table, half the bytes of a decode step's largest read, except for
        the `EXACT_CHANNELS` input channels where the copy's error weighs most, whose products come from this
        table's columns; each row's best outputs are then recomputed from the table. Every product goes this way
        (a prompt's logits too): a full cache's perplexity, computed from a prompt's logits, is then that of the
        same head as a decode step's. `inputs` (T, K): the head's inputs on a calibration text, to find those
        channels (without them: the channels whose columns the copy represents worst). `empty`: shapes only."""
        self.refine_top = REFINED_AFTER_4BIT
        N, K = self.out_features, self.in_features
        C = exact_channel_count(K)
        if empty:
            self.fast = Int4Linear.empty(N, K)
            if C:
                self.exact_channels = torch.empty(C, dtype=torch.long, device="meta")
                self.exact_columns = torch.empty(N, C, dtype=torch.int8, device="meta")
            return
        w = self.dequantize()  # (N, K)
        if C:
            error = (w - _int4_rounded(w)).square_().mean(0)  # (K,): the copy's error per input channel
            weight = inputs.float().square().mean(0) if inputs is not None else 1.0  # the channel's mean x^2
            self.exact_channels = (error * weight).topk(C).indices.sort().values  # (C,)
            self.exact_columns = self.weight_int8[:, self.exact_channels].contiguous()  # (N, C), the table's scales
            w[:, self.exact_channels] = 0
        self.fast = Int4Linear.from_float(w)

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
            channels = self.exact_channels
            if channels is None:
                y = self.fast.matvec(x2).to(x.dtype)
            else:  # the copy's columns there hold 0 only to within its grid: those inputs are zeroed for it
                y = self.fast.matvec(x2.index_fill(-1, channels, 0)).to(x.dtype)
                xc = x2[:, channels].to(COMPUTE).contiguous()  # (M, C)
                y = y + torch.ops.aten._weight_int8pack_mm(xc, self.exact_columns, self.scales).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(COMPUTE).contiguous(), self.weight_int8, self.scales)
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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: parameters and the packed linears' buffers, each tensor once (a tied table
    counts once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen or t.is_floating_point() and t.dim() < 1:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# -- a model's linears packed ------------------------------------------------------------------------------
def _tied(head: nn.Module | None, embed: nn.Module | None) -> bool:
    if head is None or embed is None:
        return False
    a, b = head.weight, embed.weight
    return a is b or a.device.type != "meta" and a.data_ptr() == b.data_ptr()


def quantize_model(
    model: nn.Module,
    fmt: str,
    int4_blocks: dict | None = None,
    empty: bool = False,
    calibration: torch.Tensor | None = None,
) -> None:
    """Replace the model's linears in place with packed ones (`fmt` "4bit": int4 groups of 32, "8bit": int8 per
    channel), the embedding and the LM head with one int8 table (shared when they are tied). With 4-bit weights
    the linears of a module that read its one input are joined into one product (`JOINED`), and the LM head
    multiplies through a 4-bit copy of its table but for the channels that `calibration` (1, T) token ids show
    its error weighs most on (`Int8Linear.use_4bit_products`). `int4_blocks` (`gguf_q4.gguf_int4_blocks`):
    linears whose file holds 4-bit values, taken as they are. `empty`: the same modules with their shapes only
    (meta tensors), to assign a saved packed model's tensors to (`packed.py`)."""
    int4_blocks = int4_blocks or {}
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = _tied(head, embed)
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        groups = _joined_groups(model, module) if fmt == "4bit" else {}
        for joined, parts in groups.items():
            linears = [getattr(module, p) for p in parts]
            if empty:
                new = Int4Linear.empty(sum(p.out_features for p in linears), linears[0].in_features, _has_bias(linears))
            else:
                values = [_int4_values(p, prefix + n, int4_blocks) for n, p in zip(parts, linears, strict=True)]
                q, scale, zero = (torch.cat(v) for v in zip(*values, strict=True))
                new = Int4Linear.from_values(q, scale, zero, _joined_bias(linears))
            join_linears(module, joined, parts, new)
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or child is head:
                continue
            full = prefix + child_name
            bias = child.bias is not None
            if fmt == "4bit" and child.in_features % GROUP == 0:
                if empty:
                    new = Int4Linear.empty(child.out_features, child.in_features, bias)
                else:
                    new = Int4Linear.from_values(*_int4_values(child, full, int4_blocks), child.bias)
            else:
                new = (
                    Int8Linear.empty(*child.weight.shape, bias)
                    if empty
                    else Int8Linear.from_float(child.weight, child.bias)
                )
            setattr(module, child_name, new)
    dtype = embed.weight.dtype
    if head is not None:
        if empty:
            table = Int8Linear.empty(*head.weight.shape, head.bias is not None)
        else:
            table = Int8Linear.from_float(head.weight, head.bias)
        model.set_output_embeddings(table)
        if tied:
            model.set_input_embeddings(Int8Embedding(table, dtype, getattr(embed, "padding_idx", None)))
    if not tied and embed is not None:
        other = Int8Linear.empty(*embed.weight.shape) if empty else Int8Linear.from_float(embed.weight)
        model.set_input_embeddings(Int8Embedding(other, dtype, getattr(embed, "padding_idx", None)))
    if head is not None and fmt == "4bit":
        inputs = None if empty or calibration is None else head_inputs(model, calibration)
        table.use_4bit_products(inputs, empty)
    elif head is not None:
        table.refine_top = REFINED
    if fmt == "4bit":
        model.prompt_products = prompt_products  # the engine reads prompt chunks inside it


@torch.inference_mode()
def head_inputs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(T, K): what the LM head is given for the tokens `ids` (1, T), from one plain forward."""
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def _int4_values(linear: nn.Linear, name: str, blocks: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear's 4-bit (q, scale, zero): the file's own (`blocks`), else quantized from its floats."""
    return blocks[name] if name in blocks else quantize_int4(linear.weight)


def _has_bias(linears: list[nn.Linear]) -> bool:
    return any(p.bias is not None for p in linears)


def _joined_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    if not _has_bias(linears):
        return None
    return torch.cat([p.bias.detach() if p.bias is not None else torch.zeros(p.out_features) for p in linears])
