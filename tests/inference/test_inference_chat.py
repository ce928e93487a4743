"""inference/chat.py: one conversation tokenizes the same for preprocess, per-turn SFT, the GRPO
recipe's prompts and the TRL rollout, and a wrong conversation is one error naming file:line:field
for preprocess and per-turn SFT alike."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import datasets
import pytest

from nopad.inference.chat import encode_prompt, render, tokenize_conversation
from nopad.packing.row import IGNORE_INDEX
from nopad.training import nopad_rollout_func
from nopad.training.sft_data import load_rows, per_turn_samples
from tests.training.test_training_trl import make_tokenizer

# the TRL rollout's module, by its public name, so that moving the module does not break this test
tokenize_prompts = sys.modules[nopad_rollout_func.__module__].tokenize_prompts

# each turn closed by <eos>, as real templates close theirs (the model learns to stop)
TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant {% endif %}"
)
CHAT = [
    {"role": "user", "content": "w1 w2"},
    {"role": "assistant", "content": "w3 w4"},
    {"role": "user", "content": "w5"},
    {"role": "assistant", "content": "w6 w7 w8"},
]


@pytest.fixture(scope="module")
def tok():
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_one_conversation_tokenizes_the_same_on_every_path(tok, tmp_path):
    from nopad.recipes.config import from_dict
    from nopad.recipes.grpo import build_prompts
    from nopad.recipes.grpo_config import GRPORecipeConfig
    from nopad.recipes.preprocess import tokenize_dataset

    ids, labels = tokenize_conversation(tok, CHAT)
    words = tok.convert_ids_to_tokens(ids)
    assert (
        words
        == (
            "<bos> user w1 w2 <eos> <bos> assistant w3 w4 <eos> <bos> user w5 <eos> <bos> assistant w6 w7 w8 <eos>"
        ).split()
    )
    trained = [w for w, label in zip(words, labels) if label != IGNORE_INDEX]
    assert trained == ["w3", "w4", "<eos>", "w6", "w7", "w8", "<eos>"]

    # preprocess (SFT on packed data)
    row = tokenize_dataset(datasets.Dataset.from_list([{"messages": CHAT}]), tok)[0]
    assert (row["input_ids"], row["labels"]) == (ids, labels)

    # per-turn SFT: each sample a prefix of the whole, together the same trained tokens
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    data = SimpleNamespace(source=str(path), per_turn_samples=True, messages_column="messages", split=None)
    samples = load_rows(data, tok, vocab_size=128)
    assert [len(s.ids) for s in samples] == [10, len(ids)]
    mask = [False] * len(ids)
    for sample in samples:
        assert list(sample.ids) == ids[: len(sample.ids)]
        mask = [m or bool(s) for m, s in zip(mask, list(sample.loss_mask) + [False] * len(ids))]
    assert mask == [label != IGNORE_INDEX for label in labels]

    # GRPO: the recipe's prompt of the first user turn is the conversation up to the first answer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2", "answer": "w3"}) + "\n")  # what the reward reads
    cfg = from_dict(
        GRPORecipeConfig, {"model": {"path": "tiny:llama", "chat_template": True}, "task": {"prompts": str(prompts)}}
    )
    _, (recipe_prompt,) = build_prompts(cfg, tok)
    first_answer = labels.index(next(label for label in labels if label != IGNORE_INDEX))
    assert recipe_prompt == ids[:first_answer] == encode_prompt(tok, "w1 w2", chat=True)

    # the TRL rollout: the same prompt, and a multi-turn prompt up to the second answer
    trainer = SimpleNamespace(
        processing_class=tok, args=SimpleNamespace(chat_template_kwargs=None), environment_factories=None, tools=None
    )
    second_answer = len(ids) - 4
    assert tokenize_prompts([CHAT[:1], CHAT[:3]], trainer) == [ids[:first_answer], ids[:second_answer]]


def test_render_needs_a_template_and_refuses_a_template_that_is_not_a_prefix(tok):
    plain = make_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat_template"):
        render(plain, CHAT)
    assert encode_prompt(plain, "w1", chat="auto") == plain.encode("w1", add_special_tokens=False)
    reverse = make_tokenizer()
    reverse.chat_template = "{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}"
    with pytest.raises(ValueError, match="prefix-consistent template"):
        tokenize_conversation(reverse, CHAT)


@pytest.mark.parametrize(
    "messages,message",
    [
        (
            [{"role": "wizard", "content": "w1"}, {"role": "assistant", "content": "w2"}],
            r"chats.jsonl:2: messages\[0\].role 'wizard' is not a chat role",
        ),
        (
            [
                {"role": "user", "content": "w1"},
                {"role": "assistant", "content": "w2"},
                {"role": "assistant", "content": "w3"},
            ],
            r"chats.jsonl:2: messages\[1\] and messages\[2\] are two assistant turns in a row",
        ),
        ([{"role": "assistant", "content": "w2"}], r"chats.jsonl:2: messages\[0\] is an assistant turn before"),
        (
            [{"role": "user", "content": None}, {"role": "assistant", "content": "w2"}],
            r"chats.jsonl:2: messages\[0\].content must be a string, got null",
        ),
        ([{"content": "w1"}, {"role": "assistant", "content": "w2"}], r"chats.jsonl:2: messages\[0\].role is missing"),
    ],
)
def test_per_turn_sft_names_the_line_and_field_of_a_wrong_conversation(tok, tmp_path, messages, message):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": messages}) + "\n")
    data = SimpleNamespace(source=str(path), per_turn_samples=True, messages_column="messages", split=None)
    with pytest.raises(ValueError, match=message):
        load_rows(data, tok, vocab_size=128)
    with pytest.raises(ValueError, match=message.replace("chats.jsonl:2", "conversation 0")):
        per_turn_samples([{"messages": messages}], tok)  # rows given in Python: named by their index
