"""Saved conversations with their cache (issue 50): save -> restore -> continue is continuing without a break, for
every kind of state a cache holds; files of another model, policy or version, and damaged ones, are refused in
one line with nothing changed. Tiny random models (a word-level tokenizer), greedy, eager steps."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import random
import textwrap

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from h2o_chat.app import statefile
from h2o_chat.app.chat import resume
from h2o_chat.app.chat.conversation import ChatSettings, Conversation
from h2o_chat.app.chat.ledger import Ledger
from h2o_chat.app.chat.resume import load_conversation, save_conversation
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.sampling import Sampler
from h2o_chat.engine.storage.persist import StateError
from h2o_chat.errors import H2OChatError
from h2o_chat.models.loading import Loaded
from h2o_chat.models.registry import ModelSpec


def tiny_loaded(seed: int = 0, max_positions: int = 8192, device: str = "cpu") -> Loaded:
    model = tiny_model("llama", seed=seed, max_positions=max_positions).to(device)
    return Loaded(model, tiny_tokenizer(), ModelSpec("tiny", "tiny"), torch.device(device), torch.float32, "none")


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(4, 256)}" for _ in range(n))


def chat(loaded: Loaded, policy=("snap", 24), **settings) -> Conversation:
    settings = {"max_new_tokens": 10, "sampler": Sampler(0.0), "decode": "eager", "chunk_size": 16, **settings}
    return Conversation(loaded, make_policy(*policy), ChatSettings(**settings))


def reply(conv: Conversation, text: str) -> list[int]:
    return [r.token for r in conv.send(text)]


def talked(loaded: Loaded, turns: int = 2, policy=("snap", 24), **settings) -> Conversation:
    """A conversation of `turns` long messages and their replies: well past the budget, so eviction chose."""
    conv = chat(loaded, policy, **settings)
    for k in range(turns):
        reply(conv, words(k, 40))
    return conv


CASES = {
    "h2o": dict(policy=("h2o", 24)),
    "snap": dict(policy=("snap", 24)),
    "recall with its store": dict(policy=("recall", 32)),
    "rolling past the trained context": dict(policy=("h2o", 24), positions="rolling", max_positions=64),
    "recall renumbered past the context": dict(policy=("recall", 32), positions="auto", max_positions=80),
    "8-bit keys and values": dict(policy=("snap", 24), kv_quant="8bit"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_save_restore_continue_is_continuing_without_a_break(case, tmp_path, single_thread):
    """The next reply after /load (in a new conversation, as --resume makes it) is token for token the reply the
    conversation gives without stopping, and the cache it leaves is the same, tensor for tensor."""
    kw = dict(CASES[case])
    loaded = tiny_loaded(max_positions=kw.pop("max_positions", 8192))
    conv = talked(loaded, **kw)
    if "renumbered" in case or "rolling" in case:
        assert conv.cache.seq.renumbered  # the saved keys are rotated at their renumbered positions
    if "recall" in case:
        assert conv.cache.stats().store_tokens > 0  # evicted tokens are in the store
    path, cache_bytes = save_conversation(conv, tmp_path / "talk.h2o")
    assert cache_bytes == conv.cache.slots.nbytes() + (conv.cache.store.nbytes() if conv.cache.store else 0)
    assert cache_bytes < path.stat().st_size < cache_bytes + 16_384  # the budget's bytes, a small header

    again = chat(loaded, **kw)
    assert load_conversation(again, path) == 4 and again.messages == conv.messages
    assert again.fed == conv.fed and again.ledger.spans == conv.ledger.spans
    question = words(99, 12)
    assert reply(again, question) == reply(conv, question)
    for name, t in conv.cache.slots.tensors().items():
        assert torch.equal(t, again.cache.slots.tensors()[name]), name
    if conv.cache.store is not None:
        for name, t in conv.cache.store.tensors().items():
            assert torch.equal(t, again.cache.store.tensors()[name]), name
        assert conv.cache.store.host() == again.cache.store.host()
    assert [r.__dict__ for r in conv.cache.seq.rows] == [r.__dict__ for r in again.cache.seq.rows]


def test_a_restore_into_storage_of_the_same_shape_is_in_place(tmp_path, single_thread):
    """/load into a conversation whose cache has storage of the file's shape overwrites it in place: a compiled
    or captured step keeps reading the same memory (the cache's version does not move)."""
    loaded = tiny_loaded()
    path, _ = save_conversation(talked(loaded), tmp_path / "talk.h2o")
    other = talked(loaded, turns=1)
    keys, version = other.cache.slots.keys.data_ptr(), other.cache.version
    load_conversation(other, path)
    assert other.cache.slots.keys.data_ptr() == keys and other.cache.version == version


def test_a_json_name_keeps_the_messages_alone_and_a_conversation_without_cache_reads_again(tmp_path):
    loaded = tiny_loaded()
    conv = talked(loaded, turns=1)
    path, cache_bytes = save_conversation(conv, tmp_path / "talk.json")
    assert cache_bytes == 0 and json.loads(path.read_text())["messages"] == conv.messages
    fresh = chat(loaded)
    load_conversation(fresh, path)
    assert fresh.fed == 0 and fresh.messages == conv.messages  # read again on the next turn
    empty, _ = save_conversation(chat(loaded, system="be brief"), tmp_path / "empty.h2o")  # nothing read yet
    load_conversation(fresh, empty)
    assert fresh.fed == 0 and fresh.messages == [{"role": "system", "content": "be brief"}]


def test_everything_restart_sets_is_saved_or_said_to_belong_to_one_turn():
    """`Conversation._restart` sets a conversation's bookkeeping, its ledger among it: each attribute and each of
    the ledger's fields is carried by a saved file (`resume.CARRIED`) or belongs to one turn or process
    (`resume.PER_TURN`), so a new one is never lost."""
    source = textwrap.dedent(inspect.getsource(Conversation._restart))
    assigned = {
        t.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for t in ast.walk(target)
        if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"
    }
    said = [*resume.CARRIED.values(), *resume.PER_TURN]
    assert assigned == {where.split(".")[0] for where in said}
    ledger = {f.name for f in dataclasses.fields(Ledger)}
    assert ledger == {where.split(".")[1] for where in said if where.startswith("ledger.")}


def test_a_field_added_to_the_declarations_is_saved_and_an_older_file_refused(monkeypatch, tmp_path):
    """What a file holds derives from the declarations: a slot field added to `slots.FIELDS` is saved and
    restored without another edit, and a file saved before it was declared is refused, naming the field."""
    from h2o_chat.engine.storage import slots as slots_module

    loaded = tiny_loaded()
    before, _ = save_conversation(talked(loaded, turns=1), tmp_path / "before.h2o")
    mark = slots_module.Field("mark", -7, torch.int32)
    monkeypatch.setattr(slots_module, "FIELDS", (*slots_module.FIELDS, mark))
    conv = talked(loaded, turns=1)
    with torch.inference_mode():
        conv.cache.slots.mark.copy_(conv.cache.slots.pos.to(torch.int32))
    path, _ = save_conversation(conv, tmp_path / "after.h2o")
    again = chat(loaded)
    load_conversation(again, path)
    assert torch.equal(again.cache.slots.mark, conv.cache.slots.mark)
    with pytest.raises(StateError, match="mark"):
        load_conversation(chat(loaded), before)


def unchanged(conv: Conversation):
    """What a refused /load must leave as it was."""
    return conv.messages, conv.fed, conv.cache.slots.keys.clone(), conv.cache.slots.pos.clone()


def assert_unchanged(conv: Conversation, before) -> None:
    messages, fed, keys, pos = before
    assert conv.messages == messages and conv.fed == fed
    assert torch.equal(conv.cache.slots.keys, keys) and torch.equal(conv.cache.slots.pos, pos)


@pytest.mark.parametrize(
    ("other", "fragment"),
    [
        (dict(seed=1), "other weights of tiny"),
        (dict(policy=("h2o", 24)), "policy snap 24; this chat runs h2o 24"),
        (dict(policy=("snap", 32)), "policy snap 24; this chat runs snap 32"),
        (dict(policy=("snap", 24), heavy_ratio=0.25), "heavy_ratio 0.5"),
        (dict(positions="rolling"), "--positions auto; this chat runs --positions rolling"),
        (dict(kv_quant="8bit"), "keys and values in the model's dtype"),
    ],
)
def test_a_file_of_another_model_or_policy_is_refused_naming_the_difference(other, fragment, tmp_path):
    path, _ = save_conversation(talked(tiny_loaded()), tmp_path / "talk.h2o")
    other = dict(other)
    loaded = tiny_loaded(seed=other.pop("seed", 0))
    policy = make_policy(*other.pop("policy", ("snap", 24)), heavy_ratio=other.pop("heavy_ratio", None))
    conv = talked(loaded, turns=1, policy=(policy.name, policy.budget), **other)
    if policy != conv.policy:
        conv.set_policy(policy)
    before = unchanged(conv)
    with pytest.raises(StateError) as e:
        load_conversation(conv, path)
    assert fragment in str(e.value) and "refused" in str(e.value) and "\n" not in str(e.value)
    assert_unchanged(conv, before)


def test_a_file_of_another_format_version_or_kind_is_refused(tmp_path, monkeypatch):
    loaded = tiny_loaded()
    conv = talked(loaded, turns=1)
    monkeypatch.setattr(statefile, "VERSION", 2)
    path, _ = save_conversation(conv, tmp_path / "future.h2o")
    monkeypatch.undo()
    before = unchanged(conv)
    with pytest.raises(StateError, match="format version 2; this h2o-chat .* reads version 1"):
        load_conversation(conv, path)
    prompt = tmp_path / "prompt.cache"
    statefile.write(prompt, "prompt", {}, None, {}, prompt={})
    with pytest.raises(StateError, match="is a prompt cache, not a saved conversation"):
        load_conversation(conv, prompt)
    assert_unchanged(conv, before)


def damaged_copies(data: bytes) -> dict[str, bytes]:
    """The file cut at several places, and with one bit flipped in its header, its digest and its tensors."""
    n = int.from_bytes(data[:8], "little")
    cuts = {f"cut at {k}": data[:k] for k in (0, 5, 8 + n // 2, 8 + n, len(data) // 2, len(data) - 1)}

    def flip(at: int, bit: int = 0) -> bytes:
        return data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1 :]

    return {
        **cuts,
        "a bit in the header's JSON": flip(data.index(b'fed\\": ') + 7, 0),  # a digit of the tokens fed
        "a bit in the digest": flip(data.index(b'"sha256"') + 12, 1),
        "a bit in a tensor's shape": flip(data.index(b'"shape"') + 10, 0),
        "a bit in the keys": flip(8 + n + 100, 3),
        "a bit in the last tensor byte": flip(len(data) - 1, 6),
        "a byte appended": data + b"\0",
    }


def test_truncated_and_bit_flipped_files_are_refused_and_nothing_changes(tmp_path, monkeypatch):
    """A damaged file is one line (truncated, damaged, or no state file at all) and the conversation that tried
    to load it is as it was; a failed write leaves the file it would replace whole, and no temporary file."""
    loaded = tiny_loaded()
    path, _ = save_conversation(talked(loaded), tmp_path / "talk.h2o")
    data = path.read_bytes()
    conv = talked(loaded, turns=1)
    before = unchanged(conv)
    for what, bad in damaged_copies(data).items():
        copy = tmp_path / "bad.h2o"
        copy.write_bytes(bad)
        if not statefile.is_state_file(copy):  # too short to be one: /load reads it as a JSON conversation
            with pytest.raises(H2OChatError) as e:
                load_conversation(conv, copy)
        else:
            with pytest.raises(StateError) as e:
                load_conversation(conv, copy)
            assert any(w in str(e.value) for w in ("truncated", "damaged", "not an h2o-chat state file")), what
        assert "\n" not in str(e.value), what
        assert_unchanged(conv, before)
    assert path.read_bytes() == data

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(StateError, match="No space left"):
        save_conversation(conv, path)
    assert path.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["bad.h2o", "talk.h2o"]


def test_resume_takes_the_files_model_and_cache_settings_unless_given(tmp_path):
    from h2o_chat.app.options import CacheOptions, ModelOptions

    conv = talked(tiny_loaded(), turns=1, policy=("h2o", 24), positions="rolling", kv_quant="8bit")
    path, _ = save_conversation(conv, tmp_path / "talk.h2o")
    models, cache, policy = ModelOptions(), CacheOptions(), make_policy("snap", 512)
    m, c, p = resume.resumed_settings(path, set(), models, cache, policy)
    assert p == conv.policy and (c.positions, c.kv_quant) == ("rolling", "8bit") and m.model == "tiny"
    m, c, p = resume.resumed_settings(path, {"budget", "positions", "model"}, models, cache, policy)
    assert p == policy and c.positions == "auto" and c.kv_quant == "8bit" and m.model is None
    with pytest.raises(StateError, match="not an h2o-chat state file|truncated"):
        (tmp_path / "cut.h2o").write_bytes(path.read_bytes()[:40])
        resume.resumed_settings(tmp_path / "cut.h2o", set(), models, cache, policy)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_saved_conversation_moves_between_cpu_and_cuda(tmp_path):
    """Files hold no device: one saved on the CPU is restored on a GPU, and back, tensor for tensor; the GPU
    continues it as the CPU does (greedy tokens; logits to float32 rounding)."""
    cpu = tiny_loaded()
    conv = talked(cpu)
    path, _ = save_conversation(conv, tmp_path / "cpu.h2o")
    gpu = tiny_loaded(device="cuda")
    on_gpu = chat(gpu)
    load_conversation(on_gpu, path)
    assert on_gpu.cache.slots.keys.device.type == "cuda"
    for name, t in conv.cache.slots.tensors().items():
        assert torch.equal(t, on_gpu.cache.slots.tensors()[name].cpu()), name
    question = words(99, 12)
    assert reply(on_gpu, question)[:3] == reply(conv, question)[:3]
    back, _ = save_conversation(on_gpu, tmp_path / "gpu.h2o")
    on_cpu = chat(cpu)
    load_conversation(on_cpu, back)
    for name, t in on_gpu.cache.slots.tensors().items():
        assert torch.equal(t.cpu(), on_cpu.cache.slots.tensors()[name]), name
