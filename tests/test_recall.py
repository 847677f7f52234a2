"""Multi-turn recall: conversations read as the chat reads them, and scores that are what the answers contain."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from h2o_chat.app import cli
from h2o_chat.app.chat.conversation import ChatSettings, Conversation
from h2o_chat.app.messages import chat_ids
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.generate import Sampler
from h2o_chat.measure import dialogues as dl
from h2o_chat.measure import evaluate as ev
from h2o_chat.measure import plots
from h2o_chat.measure import recall as rc
from h2o_chat.measure.bench import attention
from h2o_chat.models.loading import Loaded
from h2o_chat.models.registry import ModelSpec

runner = CliRunner()


def tiny_loaded(seed: int = 0, max_positions: int = 8192) -> Loaded:
    model = tiny_model("llama", seed=seed, max_positions=max_positions)
    return Loaded(model, tiny_tokenizer(), ModelSpec("tiny", "tiny"), torch.device("cpu"), torch.float32, "none")


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(4, 256)}" for _ in range(n))


# -- pure parts ----------------------------------------------------------------------------------------------
def test_hits_and_gain_kept_are_what_the_answers_contain():
    assert rc.hit("maple-42", "The passkey for your account is Maple-42.") and not rc.hit("4821", "It is 4812.")
    assert rc.gain_kept([10, 10], [2, 4], [2, 4]) == 1.0  # as good as the full cache
    assert rc.gain_kept([10, 10], [2, 4], [10, 10]) == 0.0  # as if the fact had never been said
    assert rc.gain_kept([10, 10], [2, 4], [6, 7]) == pytest.approx(7 / 14)  # summed, then divided
    assert rc.gain_kept([1, 1], [2, 1], [1, 1]) is None  # the full cache gains nothing: no share to keep
    lo, hi = rc.bootstrap([10, 9, 12, 8], [2, 4, 3, 3], [6, 7, 5, 4])
    assert lo <= rc.gain_kept([10, 9, 12, 8], [2, 4, 3, 3], [6, 7, 5, 4]) <= hi


def test_summary_counts_what_each_answer_contains():
    tok = tiny_tokenizer()
    convs = [_dialogue(tok, random.Random(k)) for k in range(3)]
    configs = [rc.RecallConfig("recent", ev.BudgetSpec.parse("10%"))]
    value = [d.answer[d.scored[0] : d.scored[1]] for d in convs]
    results = {
        "full": [(1.0, [5, *value[0]]), (1.5, [6]), (0.5, value[2])],  # two answers name the fact
        "without fact": [(4.0, [7]), (4.0, [7]), (4.0, [7])],
        "recent 10%": [(4.0, []), (4.0, [9]), (4.0, [value[0][0] + 1])],  # forgets everything
    }
    full, without, broken = rc.summarise(tok, convs, configs, results, 1.0)
    assert (full["hits"], without["hits"], broken["hits"]) == (2, 0, 0)
    for r in (full, without, broken):
        assert r["hits"] == sum(dl_hit(a) for a in r["answers"]) and r["conversations"] == 3
    assert full["gain_kept"] == 1.0 and without["gain_kept"] == 0.0 and broken["gain_kept"] == 0.0
    assert broken["hits_vs_full"] == 0.0 and broken["budget"] == round(sum(round(d.tokens / 10) for d in convs) / 3)


def dl_hit(answer: dict) -> bool:
    return answer["fact"].lower() in answer["answer"].lower()


def _dialogue(tok, rng: random.Random, turns: int = 4, reply: int = 5) -> dl.Dialogue:
    """A conversation of tiny-tokenizer words (every word one token)."""
    users = [words(rng, rng.randrange(6, 12)) for _ in range(turns)]
    replies = [words(rng, reply) for _ in range(turns - 1)]
    messages = dl._alternate(users, replies)
    neutral = dl._alternate([words(rng, 5), *users[1:]], replies)
    fact = words(rng, 2)
    answer = dl._encode(tok, f"w4 {fact} w5")
    return dl.Dialogue(
        messages=messages,
        turns=dl.turn_ids(tok, messages),
        replies=[dl._encode(tok, r) for r in replies],
        neutral_turns=dl.turn_ids(tok, neutral),
        answer=answer,
        scored=(1, 3),
        kind="name",
        fact=fact,
        fact_turn=0,
        sources=(),
    )


# -- running conversations -----------------------------------------------------------------------------------
def test_full_cache_scores_equal_one_forward_and_a_roomy_budget_equals_full(single_thread):
    model, tok = tiny_model("llama", seed=3), tiny_tokenizer()
    convs = [_dialogue(tok, random.Random(k)) for k in range(3)]
    records = rc.recall(
        model, tok, convs, ["h2o", "recent"], [ev.BudgetSpec.parse("200"), ev.BudgetSpec.parse("4")], group=2
    )
    by = {(r["policy"], r["spec"]): r for r in records}
    full = by["full", None]
    for d, answer in zip(convs, full["answers"], strict=True):
        seq = [t for k, turn in enumerate(d.turns) for t in turn + (d.replies[k] if k < len(d.replies) else [])]
        ids = torch.tensor([seq + d.answer])
        with attention(model, "sdpa"), torch.inference_mode():
            logits = model(ids).logits[0, len(seq) - 1 : -1].float()
        nll = F.cross_entropy(logits, torch.tensor(d.answer), reduction="none")[d.scored[0] : d.scored[1]].sum()
        assert answer["nll"] == pytest.approx(float(nll), abs=2e-3)  # the chat path's NLL is the model's
    roomy = by["h2o", "200"]  # room for the answer too
    assert [a["nll"] for a in roomy["answers"]] == pytest.approx([a["nll"] for a in full["answers"]], abs=1e-3)
    assert [a["answer"] for a in roomy["answers"]] == [a["answer"] for a in full["answers"]]
    assert roomy["gain_kept"] == pytest.approx(1.0, abs=1e-3) or full["gain_kept"] is None
    tight = by["recent", "4"]
    assert tight["budget"] == 4 and tight["budget_range"] == [4, 4]
    for r in records:
        assert r["hits"] == sum(dl_hit(a) for a in r["answers"])


def test_conversations_are_read_as_the_chat_reads_them():
    loaded = tiny_loaded()
    tok = loaded.tokenizer
    texts = {"a.txt": words(random.Random(1), 400), "b.txt": words(random.Random(2), 400)}
    convs = dl.dialogues(tok, texts, count=3, turns=6, passage_tokens=30, reply_tokens=8)
    conv = Conversation(loaded, make_policy("h2o", 64))
    for d in convs:
        assert len(d.turns) == 6 and len(d.replies) == 5 and all(len(r) == 8 for r in d.replies[2:])
        for k in range(1, 6):  # what the chat appends for user turn k, after the fixed reply before it
            conv.messages, conv.fed = d.messages[: 2 * k], 1
            assert conv._new_turn(d.messages[2 * k])[0] == d.turns[k]
        assert d.turns[0] == chat_ids(tok, d.messages[:1])
        assert d.neutral_turns[2:] == d.turns[2:] and d.neutral_turns[:2] != d.turns[:2]


def test_dialogues_state_facts_and_ask_for_one(embedded):
    tok = embedded.tokenizer
    texts = {name: ev.read_text(shipped=name) for name in dl.RECALL_TEXTS}
    convs = dl.dialogues(tok, texts, count=6, turns=8, passage_tokens=60)
    assert len({d.fact for d in convs}) == 6 and {d.sources[0] for d in convs} == set(dl.RECALL_TEXTS)
    for d in convs:
        seq = [t for k, turn in enumerate(d.turns) for t in turn + (d.replies[k] if k < len(d.replies) else [])]
        assert seq == d.transcript(tok)  # turn by turn, the cache sees the conversation rendered whole
        assert tok.decode(d.answer[d.scored[0] : d.scored[1]]).strip() == d.fact
        stated = tok.decode(d.turns[d.fact_turn])
        assert d.fact in stated and d.fact not in tok.decode(d.neutral_turns[d.fact_turn])
        assert d.fact not in tok.decode(d.turns[-1])  # the question asks; it does not tell


# -- a conversation appends -------------------------------------------------------------------------------
def talk(conv: Conversation, texts: list[str]) -> None:
    for text in texts:
        for _ in conv.send(text):
            pass


def test_a_conversation_appends_each_turn(single_thread):
    loaded = tiny_loaded(seed=7)
    rng = random.Random(7)
    settings = ChatSettings(max_new_tokens=2, sampler=Sampler(temperature=0), chunk_size=8)
    conv = Conversation(loaded, make_policy("snap", 12, window=3), settings)
    talk(conv, [words(rng, 10), words(rng, 10)])
    assert conv.cache.stats().seen == conv.fed  # each turn's new tokens, appended: nothing read twice


# -- the command ---------------------------------------------------------------------------------------------
def test_recall_command_json_table_and_plot(fast_load, tiny_folder, tmp_path, capsys):
    png, md = tmp_path / "recall.png", tmp_path / "recall.md"
    common = ["--model", str(tiny_folder), "--conversations", "3", "--turns", "4", "--passage-tokens", "20"]
    result = runner.invoke(
        cli.app,
        ["eval", "recall", *common, "-b", "30%", "-p", "h2o", "-p", "snap", "-p", "recall", "--json"]
        + ["--plot", str(png)]
        + ["--markdown", str(md), "--group", "2", "--snap-window", "4"],
    )
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["policy"], r["spec"]) for r in records] == [
        ("full", None), ("without fact", None), ("h2o", "30%"), ("snap", "30%"), ("recall", "30%"),
    ]  # fmt: skip
    for r in records:
        assert r["conversations"] == 3 and r["turns"] == 4 and len(r["answers"]) == 3
        assert r["hits"] == sum(dl_hit(a) for a in r["answers"])
        assert r["texts"] == "workshop.txt, as_you_like_it.txt" and math.isfinite(r["nll"])
    assert records[0]["gain_kept"] in (1.0, None) and records[2]["budget_pct"] == pytest.approx(30, abs=1)
    assert png.read_bytes()[:4] == b"\x89PNG" and "| snap |" in md.read_text()
    (tmp_path / "recall.json").write_text(result.stdout)
    plots.main(["recall", str(tmp_path / "recall.json")])
    assert capsys.readouterr().out == md.read_text()
    bad = runner.invoke(cli.app, ["eval", "recall", *common[:2], "--turns", "3"])
    assert bad.exit_code != 0 and "at least 4" in bad.stderr and "Traceback" not in bad.stderr


def test_the_recall_plot_draws_a_policy_with_no_gain_to_keep(tmp_path):
    """When the full cache scores the answers as it does without the fact (a random model, or a fact the answer
    does not need), the gain kept is undefined (null): the plot leaves a gap instead of failing the whole eval
    after it ran (matplotlib's fill_between raised on None)."""
    common = {"conversations": 3, "turns": 4, "hits": 0}
    records = [
        {**common, "policy": "full", "budget": None, "budget_pct": None, "gain_kept": None},
        {**common, "policy": "without fact", "budget": None, "budget_pct": None, "gain_kept": None},
        {**common, "policy": "h2o", "budget": 40, "budget_pct": 30.0, "gain_kept": None, "gain_kept_90": None},
        {**common, "policy": "h2o", "budget": 60, "budget_pct": 45.0, "gain_kept": 0.5, "gain_kept_90": [0.2, 0.8]},
    ]
    plots.recall_plot(records, tmp_path / "recall.png")
    assert (tmp_path / "recall.png").stat().st_size > 1000
