"""Evaluation recipe: JSONL results line by line against HF greedy generation, prompt sets from
JSONL and saved HF datasets, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from nopad.recipes.config import load_config
from nopad.recipes.evaluate import DEFAULT_CONFIG, EvaluateConfig, evaluate, run_evaluate
from nopad.recipes.tasks import exact_match, load_examples
from nopad.recipes.tiny_model import AsciiTokenizer
from tests.support.models import tiny_model

PROMPTS = ["What is 1 + 2?", "7*6=", "Hello there", "ab", "The quick brown fox jumps"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")


def hf_greedy(model, tok, prompt: str) -> str:
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1] :].tolist())


def greedy_params():
    from nopad.inference import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def make_generator(model):
    from nopad.inference import Generator

    return Generator(model, block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)


def test_evaluate_writes_one_correct_line_per_prompt(model, tmp_path):
    tok = AsciiTokenizer()
    expected = [hf_greedy(model, tok, p) for p in PROMPTS]
    # the first three answers are the model's own greedy completions, the last two cannot match
    examples = [
        {"prompt": p, "answer": e if i < 3 else "\x7f never"} for i, (p, e) in enumerate(zip(PROMPTS, expected))
    ]
    out = tmp_path / "results.jsonl"
    gen = make_generator(model)
    result = evaluate(
        gen, tok, examples, exact_match, greedy_params(), output_path=out, batch_size=2, chat=False, progress=False
    )
    gen.release()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(PROMPTS)
    completion_tokens = 0
    for i, line in enumerate(lines):
        n = len(tok.encode(PROMPTS[i]))
        assert set(line) == {
            "index",
            "prompt",
            "completion",
            "score",
            "finish_reason",
            "num_prompt_tokens",
            "num_completion_tokens",
            "answer",
        }
        assert line["index"] == i
        assert line["prompt"] == PROMPTS[i]
        assert line["completion"] == expected[i]
        assert line["answer"] == examples[i]["answer"]
        assert line["score"] == (1.0 if i < 3 else 0.0)
        assert line["num_prompt_tokens"] == n
        assert line["finish_reason"] in ("stop", "length")
        if line["finish_reason"] == "length":
            assert line["num_completion_tokens"] == MAX_TOKENS
        completion_tokens += line["num_completion_tokens"]
    assert result["accuracy"] == pytest.approx(0.6)
    assert result["num_prompts"] == 5
    assert result["completion_tokens"] == completion_tokens
    assert result["prompt_tokens"] == sum(len(p) for p in PROMPTS)
    assert result["tokens_per_s"] > 0


def test_run_evaluate_from_config_on_a_saved_hf_dataset(model, tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"question": PROMPTS[:3], "answer": ["a", "b", "c"]}).save_to_disk(tmp_path / "ds")
    cfg = load_config(
        EvaluateConfig,
        overrides={
            "model": {"path": None, "chat_template": False},
            "data": {"path": str(tmp_path / "ds"), "prompt_field": "question"},
            "scorer": "tests.recipes.test_recipes_evaluate:completion_length",
            "sampling": {"max_tokens": MAX_TOKENS},
            "generator": {"num_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32},
            "output": str(tmp_path / "out.jsonl"),
        },
    )
    result = run_evaluate(cfg, model=model, tokenizer=AsciiTokenizer(), progress=False)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS[:3]
    assert [line["score"] for line in lines] == [float(len(line["completion"])) for line in lines]
    assert result["accuracy"] == pytest.approx(sum(line["score"] for line in lines) / 3)


def completion_length(completion: str, example: dict) -> float:
    return float(len(completion))


def test_load_examples_from_jsonl_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    assert load_examples(path) == [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]
    for content, message in [
        ('{"prompt": "a"}\n{"q": "b"}\n', r"p.jsonl:2 has fields \['q'\]; expected \{\"prompt\""),
        ('{"prompt": "a"}\nnot json\n', r"p.jsonl:2 is not valid JSON"),
        ('{"prompt": null}\n', r"p.jsonl:1: field 'prompt' must be a string, got null"),
        ('{"prompt": 7}\n', r"p.jsonl:1: field 'prompt' must be a string, got int 7"),
        ("[1, 2]\n", r"p.jsonl:1 is a JSON list, not an object"),
        ("", "holds no records"),
    ]:
        path.write_text(content)
        with pytest.raises(ValueError, match=message):
            load_examples(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl")


def test_bad_evaluate_configs_fail_fast(tmp_path):
    with pytest.raises(ValueError, match="model.path is missing"):
        run_evaluate(load_config(EvaluateConfig, overrides=["model.path=null"]))
    with pytest.raises(ValueError, match=r"unknown scorer 'accuracy'"):
        load_config(EvaluateConfig, overrides=["scorer=accuracy"])
    with pytest.raises(ValueError, match=r"data.path '.*nope.jsonl' does not exist"):
        load_config(EvaluateConfig, overrides=[f"data.path={tmp_path}/nope.jsonl"])
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        load_config(EvaluateConfig, overrides=["batch_size=0"])


def test_the_shipped_yaml_lists_exactly_the_defaults():
    assert load_config(EvaluateConfig, DEFAULT_CONFIG) == EvaluateConfig()


def test_evaluate_rejects_several_samples_per_prompt(model):
    from nopad.inference import SamplingParams

    with pytest.raises(ValueError, match="one completion per prompt; got sampling n=2"):
        evaluate(None, AsciiTokenizer(), [{"prompt": "a"}], exact_match, SamplingParams(n=2), progress=False)


def test_chat_template_true_without_a_template_is_refused_not_raw_text():
    from nopad.inference.chat import encode_prompt
    from nopad.recipes.tiny_model import AsciiTokenizer

    tok = AsciiTokenizer()
    with pytest.raises(ValueError, match="model.chat_template=true but the tokenizer has no chat template"):
        encode_prompt(tok, "What is 2 + 2?", chat=True)
    assert encode_prompt(tok, "hi", chat="auto") == encode_prompt(tok, "hi", chat=False) == tok.encode("hi")
    with pytest.raises(ValueError, match="must be true, false or auto"):
        encode_prompt(tok, "hi", chat="yes")


def test_the_progress_bar_moves_per_finished_sequence(model, monkeypatch):
    """One batch of 8 prompts used to show 0/8 until the whole batch was done."""
    from tests.support.progress_recorder import record_bars

    bars = record_bars(monkeypatch)
    examples = [{"prompt": p, "answer": "x"} for p in PROMPTS]
    gen = make_generator(model)
    evaluate(
        gen,
        AsciiTokenizer(),
        examples,
        exact_match,
        greedy_params(),
        batch_size=len(PROMPTS),
        chat=False,
        progress=True,
    )
    gen.release()
    assert [bar.total for bar in bars] == [len(PROMPTS)]
    assert bars[0].updates == [1] * len(PROMPTS)
