"""Generation in three layers: token steps -> a stream of response records -> the whole string.

`prefill` feeds a prompt in chunks (eviction between chunks keeps KV memory at budget + chunk), `decode_one`
feeds one token per row. `generate_steps` yields sampled tokens; `stream_generate` turns them into `Response`
records (new text, token, timings, the cache) that the CLI, the panel, batch mode and the evaluators consume.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from h2o_chat.cache import H2OCache

DEFAULT_CHUNK = 512
# progress(tokens_done, tokens_total), called after each prefill chunk; done counts prompt tokens (columns of the
# chunked prompt). A policy that reads the prompt twice (snap) reports both passes as one bar over 2x the tokens.
Progress = Callable[[int, int], None] | None


def sample_rows(
    logits: torch.Tensor, temperatures: torch.Tensor, top_p: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(B, V) logits, (B,) temperatures -> (B,) tokens: greedy where the temperature is 0, else sampled
    from the softmax at that temperature, restricted to the top_p nucleus."""
    greedy = logits.argmax(dim=-1)
    hot = temperatures > 0
    if not bool(hot.any()):
        return greedy
    probs = (logits.float() / temperatures.clamp(min=1e-6)[:, None]).softmax(dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p, 0.0)  # smallest set >= top_p
        sampled = order.gather(-1, torch.multinomial(sorted_p, 1, generator=generator)).squeeze(-1)
    else:
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(hot, sampled, greedy)


@dataclass(frozen=True)
class Sampler:
    """temperature 0 = greedy; top_p < 1 = nucleus sampling; seed makes sampling repeatable."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    _gen: dict = field(default_factory=dict, repr=False, compare=False)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if device not in self._gen:
            self._gen[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._gen[device]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) token ids."""
        if self.temperature <= 0:
            return logits.argmax(dim=-1)
        temps = torch.full((logits.shape[0],), self.temperature, device=logits.device)
        return sample_rows(logits, temps, self.top_p, self._generator(logits.device))


def _forward(model, cache: H2OCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
    out = model(
        input_ids=ids,
        position_ids=positions,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1]  # (B, V)


@torch.inference_mode()
def prefill(
    model,
    cache: H2OCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    *,
    progress: Progress = None,
) -> torch.Tensor:
    """Feed a (left-padded) prompt (B, L); returns the last position's logits (B, V). A policy that
    compresses prompts (snap) gets its two-pass selection; every other policy a chunked prefill."""
    from h2o_chat.snap import compress_prompt, compresses

    if compresses(cache):
        return compress_prompt(model, cache, input_ids, attention_mask, chunk_size, prefill_chunks, progress=progress)
    return prefill_chunks(model, cache, input_ids, attention_mask, chunk_size, progress=progress)


@torch.inference_mode()
def prefill_chunks(
    model,
    cache: H2OCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    *,
    progress: Progress = None,
) -> torch.Tensor:
    """Feed a (left-padded) prompt (B, L) in chunks, evicting between chunks (KV memory: budget + chunk).

    The cache numbers the tokens (it continues from what it has seen, so chat turns append to it)."""
    B, L = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, L, dtype=torch.long, device=input_ids.device)
    attention_mask = attention_mask.to(input_ids.device)
    padded = not bool(attention_mask.all())
    logits = None
    for s in range(0, L, chunk_size):
        mask = attention_mask[:, s : s + chunk_size]
        logits = _forward(
            model, cache, input_ids[:, s : s + chunk_size], cache.position_ids(mask), mask if padded else None
        )
        if progress is not None:
            progress(min(s + chunk_size, L), L)
    return logits


@torch.inference_mode()
def decode_one(model, cache: H2OCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row, (B,) -> next logits (B, V)."""
    positions = cache.position_ids(torch.ones(tokens.shape[0], 1, dtype=torch.long, device=tokens.device))
    return _forward(model, cache, tokens[:, None], positions, None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Step:
    """One decode step for every row: sampled tokens (B,) and the time it took."""

    tokens: torch.Tensor
    seconds: float
    prompt_seconds: float


def generate_steps(
    model,
    cache: H2OCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sampler: Sampler | None = None,
    max_new_tokens: int = 256,
    chunk_size: int = DEFAULT_CHUNK,
    *,
    progress: Progress = None,
) -> Iterator[Step]:
    """Prefill, then yield sampled tokens until max_new_tokens (the caller decides when a row is done)."""
    sampler = sampler or Sampler()
    device = input_ids.device
    t0 = time.perf_counter()
    logits = prefill(model, cache, input_ids, attention_mask, chunk_size, progress=progress)
    tokens = sampler(logits)
    _sync(device)
    prompt_seconds = time.perf_counter() - t0
    yield Step(tokens, 0.0, prompt_seconds)
    for _ in range(max_new_tokens - 1):
        t = time.perf_counter()
        tokens = sampler(decode_one(model, cache, tokens))
        _sync(device)
        yield Step(tokens, time.perf_counter() - t, prompt_seconds)


class StreamingDetokenizer:
    """Incremental decoding that never splits a multi-byte character and costs O(1) per token
    (the prefix/read offsets scheme used by vLLM and text-generation-inference)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an unfinished character: wait for the next token
        self.prefix, self.read = self.read, len(self.tokens)
        return after[len(before) :]

    def flush(self) -> str:
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        self.prefix = self.read = len(self.tokens)
        return after[len(before) :] if len(after) > len(before) else ""


@dataclass
class Response:
    """One record of the stream: the new text and where generation stands."""

    text: str
    token: int
    prompt_tokens: int
    prompt_seconds: float
    generation_tokens: int
    generation_seconds: float
    cache: H2OCache
    finish_reason: str | None = None  # "stop" | "length" | None while running

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return (self.generation_tokens - 1) / self.generation_seconds if self.generation_seconds else 0.0


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """EOS ids from the tokenizer and generation config, plus the usual end-of-turn tokens."""
    ids: set[int] = set()
    candidates: list = [tokenizer.eos_token_id]
    if model is not None and getattr(model, "generation_config", None) is not None:
        candidates.append(model.generation_config.eos_token_id)
    for c in candidates:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, Iterable):
            ids.update(int(x) for x in c)
    vocab = tokenizer.get_vocab()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>"):
        if name in vocab:
            ids.add(vocab[name])
    return ids


def stream_generate(
    model,
    tokenizer,
    cache: H2OCache,
    prompt_ids: torch.Tensor | list[int],
    *,
    sampler: Sampler | None = None,
    max_new_tokens: int = 256,
    chunk_size: int = DEFAULT_CHUNK,
    stop_ids: set[int] | None = None,
    stop_strings: tuple[str, ...] = (),
    progress: Progress = None,
) -> Iterator[Response]:
    """Generate for one prompt (a token list or (1, L) tensor), yielding a Response per token.

    The prompt is appended to whatever `cache` already holds (chat turns). Every sampled token but the last
    has been fed to the cache when the stream ends. Text that could begin a stop string is held back until
    it is clear it does not. `progress(done, total)` is called after each prefill chunk."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    stop_ids = stop_token_ids(tokenizer, model) if stop_ids is None else stop_ids
    hold = max((len(s) - 1 for s in stop_strings), default=0)
    detok = StreamingDetokenizer(tokenizer)
    pending = ""  # decoded text not yet emitted
    gen_seconds = 0.0
    steps = generate_steps(model, cache, ids, None, sampler, max_new_tokens, chunk_size, progress=progress)
    for n, step in enumerate(steps, start=1):
        gen_seconds += step.seconds
        token = int(step.tokens[0])
        reason = "stop" if token in stop_ids else ("length" if n >= max_new_tokens else None)
        if reason != "stop":
            pending += detok.add(token)
        if reason is not None:
            pending += detok.flush()
        cut = min((pending.find(s) for s in stop_strings if s in pending), default=-1)
        if cut >= 0:
            text, pending, reason = pending[:cut], "", "stop"
        elif reason is None and hold:
            text, pending = pending[: max(0, len(pending) - hold)], pending[max(0, len(pending) - hold) :]
        else:
            text, pending = pending, ""
        yield Response(text, token, ids.shape[1], step.prompt_seconds, n, gen_seconds, cache, reason)
        if reason is not None:
            return


def generate(model, tokenizer, cache: H2OCache, prompt_ids, **kwargs) -> str:
    """The whole continuation as one string."""
    return "".join(r.text for r in stream_generate(model, tokenizer, cache, prompt_ids, **kwargs))
