"""Generation in three layers: engine token steps -> a stream of response records -> the whole string.

`stream_generate` prefills a prompt through the decode engine (`h2o_chat.engine.Engine`), then turns its token
steps into `Response` records (new text, token, timings, the cache) that the CLI, the panel, batch mode and the
evaluators consume. Stop tokens and stop strings are checked on the host, one step behind the device.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.step.decode import DEFAULT_CHUNK, Engine, Progress
from h2o_chat.engine.step.sampling import Sampler

__all__ = ["DEFAULT_CHUNK", "Response", "Sampler", "StreamingDetokenizer", "generate", "stop_token_ids"]


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
    fed: bool = False  # whether this token has been fed to the cache already (the engine runs one step ahead)
    seam: tuple[str, str] | None = None  # the last record's, when a stop string cut the reply: `TextStream.seam`

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return (self.generation_tokens - 1) / self.generation_seconds if self.generation_seconds else 0.0


def finish_reason(token: int, count: int, max_new_tokens: int, stop_ids: set[int]) -> str | None:
    """Why a row's generation ends at `token`, its `count`-th: "stop" (an end token), "length", or None. The
    one rule for every loop that turns tokens into replies (chat and piped, batch, evaluations)."""
    if token in stop_ids:
        return "stop"
    return "length" if count >= max_new_tokens else None


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


class TextStream:
    """A reply's tokens -> its text (`stream_generate`, the server's rows): stop tokens and stop strings end it,
    text that could begin a stop string is held back until it cannot. A reply cut by a stop string knows where
    (`seam`): the tokens past the cut may already be in the cache."""

    def __init__(self, tokenizer, max_tokens: int, stop_ids: set[int], stops: tuple[str, ...]):
        self.detok = StreamingDetokenizer(tokenizer)
        self.max_tokens, self.stop_ids, self.stops = max_tokens, stop_ids, stops
        self.hold = max((len(s) - 1 for s in stops), default=0)
        self.pending = ""
        self.tokens: list[int] = []
        self.pieces: list[str] = []  # all the text the tokens gave, the cut-off part too
        self.ends: list[int] = []  # characters of it after each token
        self.cut: int | None = None  # a stop string cut the reply here (characters)

    def add(self, token: int) -> tuple[str, str | None]:
        """(new text, finish reason or None)."""
        self.tokens.append(token)
        reason = finish_reason(token, len(self.tokens), self.max_tokens, self.stop_ids)
        piece = self.detok.add(token) if reason != "stop" else ""
        if reason is not None:
            piece += self.detok.flush()
        self.pending += piece
        self.pieces.append(piece)
        self.ends.append((self.ends[-1] if self.ends else 0) + len(piece))
        cut = min((self.pending.find(s) for s in self.stops if s in self.pending), default=-1)
        if cut >= 0:
            self.cut = self.ends[-1] - len(self.pending) + cut
            text, self.pending, reason = self.pending[:cut], "", "stop"
        elif reason is None and self.hold:
            keep = max(0, len(self.pending) - self.hold)
            text, self.pending = self.pending[:keep], self.pending[keep:]
        else:
            text, self.pending = self.pending, ""
        return text, reason

    def seam(self, fed: int) -> tuple[str, str] | None:
        """Where a cache that has read the reply's first `fed` tokens stands against its text, when a stop string
        cut it: (the reply's text it has not read, the text past the reply it has read); one of the two is empty.
        None when no stop string cut the reply (the cache's tokens are the reply's)."""
        if self.cut is None:
            return None
        text = "".join(self.pieces)
        read = self.ends[fed - 1] if fed else 0
        return text[read : self.cut], text[self.cut : read]


def stream_generate(
    model,
    tokenizer,
    cache: H2OCache,
    prompt_ids: torch.Tensor | list[int],
    *,
    sampler: Sampler | None = None,
    max_new_tokens: int = 256,
    chunk_size: int | None = None,
    stop_ids: set[int] | None = None,
    stop_strings: tuple[str, ...] = (),
    progress: Progress = None,
    engine: Engine | None = None,
    history: list[int] | None = None,
) -> Iterator[Response]:
    """Generate for one prompt (a token list or (1, L) tensor), yielding a Response per token.

    The prompt is appended to whatever `cache` already holds (chat turns); pass the same `engine` every turn to
    keep its captured decode step. Text that could begin a stop string is held back until it is clear it does
    not. The last record's `fed` says whether its token is already in the cache. `history`: the tokens the cache
    read before (earlier turns), which the repetition penalty's window sees before the prompt's."""
    engine = engine or Engine(model, cache)
    device = engine.device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    stop_ids = stop_token_ids(tokenizer, model) if stop_ids is None else stop_ids
    stream = TextStream(tokenizer, max_new_tokens, stop_ids, stop_strings)

    engine.set_sampler(sampler or Sampler(), 1)
    t0 = time.perf_counter()
    logits = engine.prefill(ids, None, chunk_size, progress, history)
    room = cache.room()  # a model with learned positions (OPT) ends there: the reply stops, whole, at "length"
    if room is not None and room + 1 < max_new_tokens:
        max_new_tokens = stream.max_tokens = room + 1  # a reply's last token is never fed
        cache.notices.append(
            f"the reply stops after {max_new_tokens:,} tokens, at the model's trained context ({cache.context:,} "
            "tokens): its learned positions end there"
        )
    steps = engine.tokens(logits, max_new_tokens)
    first = next(steps)  # waits for the prefill and the first token
    prompt_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    for n, row_tokens in enumerate(itertools.chain((first,), steps), start=1):
        token = row_tokens[0]
        text, reason = stream.add(token)
        seconds = time.perf_counter() - t1
        fed = engine.fed_last
        seam = stream.seam(n if fed else n - 1) if reason is not None else None
        yield Response(text, token, ids.shape[1], prompt_seconds, n, seconds, cache, reason, fed, seam)
        if reason is not None:
            return


def generate(model, tokenizer, cache: H2OCache, prompt_ids, **kwargs) -> str:
    """The whole continuation as one string."""
    return "".join(r.text for r in stream_generate(model, tokenizer, cache, prompt_ids, **kwargs))
