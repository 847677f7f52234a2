"""Conversations for the multi-turn recall evaluation (`measure/recall.py`), built from a seed.

Each has `turns` user turns: a greeting with one fact, then two more facts (a name, a locker number, a short
passkey, a dog's name: three of the four kinds), then turns that ask about passages of a shipped text, then a
question for one of the facts. Replies are fixed, so every policy sees the same conversation: the fact turns get
FACT_REPLY, a passage turn "In short:" and the passage's first tokens, `reply_tokens` of them, or as many as the
set's shortest such reply has when a passage is short (every row of a batch then decodes its replies in step).
The same conversation with the asked fact's statement replaced by a neutral one measures what the answer owes to
the fact. A turn's ids are what the chat reads for it (`app/chat/conversation.py`): the first turn's whole
rendering, then what follows the previous reply.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from h2o_chat.measure.evaluate import token_ids

# texts not used to tune snap (its knobs were chosen by needle runs on alice and moby_dick)
RECALL_TEXTS = ("workshop.txt", "as_you_like_it.txt")
TITLES = {
    "workshop.txt": "the proceedings of a 1992 workshop on electronic texts",
    "as_you_like_it.txt": "Shakespeare's As You Like It",
    "alice.txt": "Alice's Adventures in Wonderland",
    "moby_dick.txt": "Moby-Dick",
}
SENTINEL = "\x00h2o-chat-reply\x00"  # as app/chat/template.py: what follows the last reply is a turn's new text


@dataclass(frozen=True)
class Kind:
    """A kind of fact: how the user states it, refers to it, asks for it, and how the answer reads."""

    name: str
    statement: str  # "My locker number is {v}."
    mention: str  # "my locker number"
    question: str
    answer: str  # "Your locker number is {v}."
    value: Callable[[random.Random], str]


_FIRST = ("Maria", "Tomas", "Aiko", "Kwame", "Elena", "Rahul", "Sofia", "Lars", "Amara", "Diego", "Ingrid", "Yusuf")
_LAST = ("Lopez", "Novak", "Tanaka", "Mensah", "Petrova", "Sharma", "Rossi", "Berg", "Okafor", "Alvarez", "Demir")
_WORDS = ("amber", "falcon", "cedar", "comet", "harbor", "maple", "orbit", "pepper", "quartz", "raven", "tundra")
_PETS = ("Biscuit", "Pepper", "Mango", "Rufus", "Luna", "Ziggy", "Clover", "Bruno", "Waffles", "Nimbus")
KINDS = (
    Kind(
        "name", "My name is {v}.", "my name", "What is my name?", "Your name is {v}.",
        lambda r: f"{r.choice(_FIRST)} {r.choice(_LAST)}",
    ),
    Kind(
        "number", "My locker number is {v}.", "my locker number", "What is my locker number?",
        "Your locker number is {v}.", lambda r: str(r.randint(1000, 9999)),
    ),
    Kind(
        "passkey", "The passkey for my account is {v}.", "the passkey for my account",
        "What is the passkey for my account?", "The passkey for your account is {v}.",
        lambda r: f"{r.choice(_WORDS)}-{r.randint(10, 99)}",
    ),
    Kind(
        "pet", "My dog is called {v}.", "what my dog is called", "What is my dog called?", "Your dog is called {v}.",
        lambda r: r.choice(_PETS),
    ),
)  # fmt: skip
NEUTRAL = (
    "I had a long day at work today.",
    "The weather here has been quite mild this week.",
    "I have been reading a lot lately.",
    "I just made myself a cup of tea.",
)
GREETINGS = ("Hi! I would like to chat about a few texts.", "Hello there.", "Good morning!", "Hi, thanks for helping.")
FACT_REPLY = "Thank you, I will keep that in mind."  # every fact turn gets this reply (every policy, every row)
REQUESTS = (
    "Summarise this passage in one sentence.",
    "What is this passage about?",
    "What is the main point of this passage?",
    "Explain this passage briefly.",
)
QUESTION = "Earlier in our conversation I told you {mention}. {question} Answer in one short sentence."


@dataclass(frozen=True)
class Dialogue:
    """One conversation: user and assistant messages ending with the final question; each user turn's new ids
    as the chat reads them (`turns`), the fixed replies between them (token ids, teacher-forced) and the answer.
    `neutral_turns`: the same turns with the asked fact's statement replaced by a neutral one."""

    messages: list[dict]
    turns: list[list[int]]
    replies: list[list[int]]
    neutral_turns: list[list[int]]
    answer: list[int]
    scored: tuple[int, int]  # answer[scored[0]:scored[1]] spell the fact's value
    kind: str
    fact: str
    fact_turn: int  # the user turn (0-based) that states it
    sources: tuple[str, ...]

    @property
    def tokens(self) -> int:
        """Tokens the cache has seen when the final question has been read."""
        return sum(map(len, self.turns)) + sum(map(len, self.replies))

    def transcript(self, tokenizer) -> list[int]:
        """The whole conversation up to the final question as one prompt (what the chat reads after a restart)."""
        return _encode(tokenizer, _render(tokenizer, self.messages))


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def turn_ids(tokenizer, messages: list[dict]) -> list[list[int]]:
    """The ids each user turn appends to the cache, as `app.conversation` computes them: the first turn's whole
    rendering, then what follows the previous reply (end of turn, the new message, the generation prompt)."""
    out = [_encode(tokenizer, _render(tokenizer, messages[:1]))]
    for k in range(2, len(messages), 2):
        marked = [dict(m) for m in messages[: k + 1]]
        marked[k - 1]["content"] = SENTINEL
        out.append(_encode(tokenizer, _render(tokenizer, marked).split(SENTINEL, 1)[1]))
    return out


def _passage(rng: random.Random, ids: list[int], tokenizer, size: int) -> str:
    start = rng.randrange(0, max(1, len(ids) - size))
    return " ".join(tokenizer.decode(ids[start : start + size]).split())


def _alternate(users: list[str], replies: list[str]) -> list[dict]:
    """User messages with the replies between them (one fewer), ending with the last user message."""
    messages = []
    for u, a in zip(users, [*replies, None], strict=True):
        messages.append({"role": "user", "content": u})
        if a is not None:
            messages.append({"role": "assistant", "content": a})
    return messages


def dialogues(
    tokenizer,
    texts: dict[str, str],
    count: int = 30,
    turns: int = 10,
    passage_tokens: int = 120,
    reply_tokens: int = 24,
    seed: int = 0,
) -> list[Dialogue]:
    """`count` conversations of `turns` user turns each (at least 4): two turns state three facts, the rest but
    the last ask about passages of `texts` (in turn), the last asks for one fact. Replies are fixed:
    FACT_REPLY, or "In short:" and the passage, cut to `reply_tokens` tokens, or to the set's shortest such reply
    when that is shorter (all rows of any batch then decode in step)."""
    if turns < 4:
        raise ValueError("a recall conversation needs at least 4 turns: two of facts, one between, the question")
    rng = random.Random(seed)
    text_ids = {name: token_ids(tokenizer, text) for name, text in texts.items()}
    names = list(texts)
    drafts = [_draft(rng, tokenizer, text_ids, names, c, turns, passage_tokens) for c in range(count)]
    # a reply is cut to one length for the whole set: a short passage ("In short:" and fewer tokens than
    # `reply_tokens`) cuts every conversation's, as rows of any batch must decode the same number of reply tokens
    cut = min([reply_tokens, *(len(r) for d in drafts for r in d["passage_replies"])])
    fact_reply = _encode(tokenizer, FACT_REPLY)
    out = []
    for d in drafts:
        replies = [fact_reply] * 2 + [r[:cut] for r in d["passage_replies"]]
        texts_of_replies = [tokenizer.decode(r, skip_special_tokens=True) for r in replies]
        messages = _alternate(d["users"], texts_of_replies)
        kind, value = d["kind"], d["value"]
        before, after = kind.answer.split("{v}")
        prefix, spelled = _encode(tokenizer, before.rstrip()), _encode(tokenizer, " " + value)
        answer = prefix + spelled + _encode(tokenizer, after)
        out.append(
            Dialogue(
                messages=messages,
                turns=turn_ids(tokenizer, messages),
                replies=replies,
                neutral_turns=turn_ids(tokenizer, _alternate(d["neutral_users"], texts_of_replies)),
                answer=answer,
                scored=(len(prefix), len(prefix) + len(spelled)),
                kind=kind.name,
                fact=value,
                fact_turn=d["fact_turn"],
                sources=d["sources"],
            )
        )
    return out


def _draft(rng: random.Random, tokenizer, text_ids: dict, names: list[str], c: int, turns: int, size: int) -> dict:
    """Conversation `c`'s facts, user turns and uncut passage replies, drawn from `rng` (in the order that makes a
    seed give the same conversations as it always did)."""
    kinds = rng.sample(KINDS, 3)
    values = [k.value(rng) for k in kinds]
    asked = rng.randrange(3)
    statements = [k.statement.format(v=v) for k, v in zip(kinds, values, strict=True)]
    neutral = list(statements)
    neutral[asked] = rng.choice(NEUTRAL)
    fact_turns = [f"{rng.choice(GREETINGS)} {{0}}", "Two more things about me. {0} {1}"]
    fact_of_turn = [0, 1, 1]  # fact i is stated in user turn fact_of_turn[i]
    users = [fact_turns[0].format(statements[0]), fact_turns[1].format(*statements[1:])]
    neutral_users = [fact_turns[0].format(neutral[0]), fact_turns[1].format(*neutral[1:])]
    passage_replies, sources = [], []
    for t in range(turns - 3):
        name = names[(c + t) % len(names)]
        passage = _passage(rng, text_ids[name], tokenizer, size)
        sources.append(name)
        users.append(f"Here is a passage from {TITLES.get(name, name)}:\n\n{passage}\n\n{rng.choice(REQUESTS)}")
        neutral_users.append(users[-1])
        passage_replies.append(_encode(tokenizer, f"In short: {passage}"))
    kind = kinds[asked]
    question = QUESTION.format(mention=kind.mention, question=kind.question)
    users.append(question)
    neutral_users.append(question)
    return {
        "kind": kind, "value": values[asked], "fact_turn": fact_of_turn[asked], "users": users,
        "neutral_users": neutral_users, "passage_replies": passage_replies, "sources": tuple(sources),
    }  # fmt: skip
