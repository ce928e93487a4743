"""A user's own prompts in evaluate and GRPO: a prompt set the reward cannot score, or an
empty prompt, is refused at start naming the records; ``contains_answer`` scores an answer given
in a sentence."""

from __future__ import annotations

import json

import pytest
import torch

from nopad.recipes.config import load_config, with_overrides
from nopad.recipes.evaluate import EvaluateConfig, run_evaluate
from nopad.recipes.grpo import GRPORecipeConfig, build_prompts, run_grpo
from nopad.recipes.tasks import contains_answer, example_fields, get_reward, load_examples
from nopad.recipes.tiny_model import AsciiTokenizer


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _no_model(*_args, **_kwargs):
    raise AssertionError("the model was loaded before the prompts were checked")


def grpo_config(**overrides) -> GRPORecipeConfig:
    base = {
        "model": {"path": "tiny:llama", "chat_template": False},
        "task": {"num_prompts": 8},
        "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_tokens": 8},
        "generator": {"num_blocks": 64, "max_num_batched_tokens": 256},
        "train": {"steps": 1, "lr": 1e-3},
    }
    return with_overrides(load_config(GRPORecipeConfig, overrides=base), overrides)


# ----------------------------------------------------------------------------- 1: what the reward reads
MISSING = [
    {"prompt": "Symbol of iron?", "answer": "Fe"},
    {"prompt": "Symbol of gold?"},
    {"prompt": "Symbol of tin?", "solution": "Sn"},
    {"prompt": "Symbol of lead?", "answer": None},
]


def test_grpo_prompts_without_the_answer_the_reward_reads_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    """They used to train on all-zero rewards, and the only message advised raising max_tokens."""
    monkeypatch.setattr("nopad.recipes.grpo.load_model", _no_model)
    path = _write(tmp_path / "p.jsonl", MISSING)
    cfg = grpo_config(task={"prompts": path}, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError) as err:
        run_grpo(cfg, progress=False)
    message = str(err.value)
    assert "task.prompts=" in message and "3 of 4 prompts have no 'answer' field" in message
    assert "reward=last_number_match compares each completion against" in message
    assert f"{path}:2, {path}:3, {path}:4" in message and "add 'answer' to every record" in message


def test_evaluate_prompts_without_the_answer_the_scorer_reads_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("nopad.recipes.evaluate.load_model", _no_model)
    path = _write(tmp_path / "p.jsonl", MISSING)
    cfg = load_config(EvaluateConfig, overrides=[f"data.path={path}", "scorer=contains_answer", "output=null"])
    with pytest.raises(
        ValueError,
        match=r"data.path=.*3 of 4 prompts have no 'answer' field, which "
        r"scorer=contains_answer compares",
    ):
        run_evaluate(cfg, progress=False)


def test_the_built_in_rewards_declare_the_answer_and_an_undeclared_reward_reads_nothing(tmp_path):
    assert all(
        example_fields(get_reward(name)) == ("answer",)
        for name in ("exact_match", "last_number_match", "contains_answer")
    )
    assert example_fields(get_reward("tests.recipes.test_recipes_grpo:length_reward")) == ()
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert load_examples(path, needs=()) == [{"prompt": "a"}, {"prompt": "b"}]
    many = _write(tmp_path / "many.jsonl", [{"prompt": str(i)} for i in range(8)])
    with pytest.raises(ValueError, match=r"8 of 8 prompts .*many.jsonl:5 and 3 more;"):
        load_examples(many, needs=("answer",))


# ----------------------------------------------------------------------------- 2: an empty prompt
def test_an_empty_prompt_is_named_as_empty_not_as_too_long(tmp_path, monkeypatch):
    """An empty prompt used to be told to "raise max_prompt_tokens"."""
    monkeypatch.setattr("nopad.recipes.grpo.load_model", _no_model)
    path = _write(
        tmp_path / "p.jsonl",
        [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "", "answer": "3"}, {"prompt": "  \n", "answer": "4"}],
    )
    cfg = grpo_config(task={"prompts": path}, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError) as err:
        run_grpo(cfg, progress=False)
    message = str(err.value)
    assert "2 prompt(s) are empty ('prompt' holds no text)" in message
    assert f"{path}:2, {path}:3" in message and "max_prompt_tokens" not in message
    # a prompt that reaches the tokenizer and encodes to nothing is named as empty too
    with pytest.raises(ValueError, match=r"prompt 0 is empty: it encodes to no tokens") as err:
        build_prompts(grpo_config(), AsciiTokenizer(), [{"prompt": "", "answer": "1"}])
    assert "max_prompt_tokens" not in str(err.value)


# ----------------------------------------------------------------------------- 4: contains_answer
@pytest.mark.parametrize(
    "completion, answer, score",
    [
        ("The chemical symbol of Iron is Fe.", "Fe", 1.0),
        ("fe", "Fe", 1.0),
        ("Iron's symbol: (FE)!", "Fe", 1.0),
        ("Feet are not iron.", "Fe", 0.0),  # a word boundary, not a substring
        ("It is in New\n  York, USA.", "new york", 1.0),
        ("York, New", "New York", 0.0),
        ("pi is about 3.14.", "3.14", 1.0),
        ("pi is about 3.141", "3.14", 0.0),
        ("it is -5 degrees", "-5", 1.0),
        ("anything", "", 0.0),
    ],
)
def test_contains_answer_matches_whole_words_ignoring_case_space_and_punctuation(completion, answer, score):
    assert contains_answer(completion, {"answer": answer}) == score
    assert get_reward("contains_answer") is contains_answer


def test_your_own_prompts_evaluate_and_train_with_contains_answer(tmp_path):
    """The README's pipeline on one's own prompt file: evaluate scores, GRPO trains, by name."""
    from tests.support.models import tiny_model

    torch.set_num_threads(1)
    records = [{"prompt": f"Q{i}: symbol of iron?", "answer": "Fe"} for i in range(4)]
    path = _write(tmp_path / "qa.jsonl", records)
    model, tok = tiny_model("llama"), AsciiTokenizer()
    out = tmp_path / "eval.jsonl"
    cfg = load_config(
        EvaluateConfig,
        overrides=[
            f"data.path={path}",
            "scorer=contains_answer",
            f"output={out}",
            "model.chat_template=false",
            "sampling.max_tokens=4",
        ],
    )
    result = run_evaluate(cfg, model=model, tokenizer=tok, progress=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["num_prompts"] == len(lines) == 4
    assert all(line["score"] == contains_answer(line["completion"], line) for line in lines)
    history = run_grpo(
        grpo_config(task={"prompts": path}, reward="contains_answer"), model=model, tokenizer=tok, progress=False
    )
    assert len(history) == 1 and 0.0 <= history[0]["reward_mean"] <= 1.0
