"""Settings that were ignored or unchecked: each is now used or refused with a
message naming the key."""

import json
import logging

import pytest
import torch

from nopad.inference import SamplingParams
from nopad.recipes.config import ConfigError, ModelConfig, load_config
from nopad.recipes.grpo import run_grpo
from nopad.recipes.grpo_config import GRPORecipeConfig as GRPOConfig
from nopad.recipes.models import load_model
from nopad.recipes.sft import train
from nopad.recipes.sft_config import SFTRecipeConfig as SFTConfig
from nopad.recipes.tasks import check_prompts_per_step


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _prompts(path, n: int) -> None:
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_top_k_minus_one_and_zero_disable_it_other_negatives_are_errors():
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=0).top_k == 0
    with pytest.raises(ValueError, match="top_k must be an int >= 1, or 0 or -1 to disable it, got -5"):
        SamplingParams(top_k=-5)


def test_evaluate_takes_the_first_num_prompts_of_a_file(tmp_path, caplog):
    from nopad.recipes.evaluate import EvaluateConfig, run_evaluate

    path = tmp_path / "prompts.jsonl"
    _prompts(path, 5)
    common = {
        "model": {"path": "tiny:llama", "chat_template": False},
        "sampling": {"max_tokens": 2},
        "generator": {"num_blocks": 64},
        "output": None,
    }
    cfg = EvaluateConfig(data={"path": str(path), "num_prompts": 2}, **common)
    assert run_evaluate(cfg, progress=False)["num_prompts"] == 2
    every = run_evaluate(EvaluateConfig(data={"path": str(path)}, **common), progress=False)
    assert every["num_prompts"] == 5
    with caplog.at_level(logging.WARNING):
        cfg = EvaluateConfig(data={"path": str(path), "num_prompts": 9}, **common)
        result = run_evaluate(cfg, progress=False)
    assert result["num_prompts"] == 5 and "data.num_prompts=9 but" in caplog.text


def test_model_dtype_applies_to_the_tiny_model():
    model, _ = load_model(ModelConfig(path="tiny:llama", dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "cls, overrides, message",
    [
        (GRPOConfig, ["loss.beta=-0.1"], "loss.beta must be a number >= 0.0, got -0.1"),
        (GRPOConfig, ["train.lr=1e38"], r"train.lr must be a number in \(0, 1\], got 1e\+38"),
        (SFTConfig, ["train.lr=1e38"], r"train.lr must be a number in \(0, 1\], got 1e\+38"),
        (SFTConfig, ["train.lr=0"], r"train.lr must be a number in \(0, 1\], got 0.0"),
        # a negative norm used to flip every gradient without a word; weight decay and the synthetic
        # lengths failed only after the model loaded; a greedy GRPO rollout learns nothing
        (SFTConfig, ["train.max_grad_norm=-1"], r"train.max_grad_norm must be a number > 0, or null or 0"),
        (GRPOConfig, ["train.max_grad_norm=-0.5"], r"train.max_grad_norm must be a number > 0, or null or 0"),
        (SFTConfig, ["train.weight_decay=-0.1"], r"train.weight_decay must be a number >= 0.0, got -0.1"),
        (GRPOConfig, ["train.weight_decay=-1"], r"train.weight_decay must be a number >= 0.0, got -1.0"),
        (SFTConfig, ["data.min_len=50", "data.max_len=10"], r"data.min_len \(50\) is above data.max_len \(10\)"),
        (GRPOConfig, ["rollout.temperature=0"], r"rollout.temperature is 0 \(greedy\): every completion"),
        (GRPOConfig, ["loss.delta=1.0"], r"loss.delta must be > 1"),
    ],
)
def test_out_of_range_training_settings_are_refused(cls, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cls, None, overrides)


def test_more_prompts_per_step_than_prompts_is_an_error_with_the_numbers(tmp_path):
    check_prompts_per_step(8, 4, world_size=2)
    with pytest.raises(
        ValueError,
        match=r"rollout.prompts_per_step=4 x 2 process\(es\) needs 8 distinct "
        "prompts per step, but the prompt set has 6",
    ):
        check_prompts_per_step(6, 4, world_size=2)
    path = tmp_path / "prompts.jsonl"
    _prompts(path, 3)
    cfg = load_config(
        GRPOConfig,
        None,
        [
            "model.path=tiny:llama",
            "model.chat_template=false",
            f"task.prompts={path}",
            "rollout.prompts_per_step=4",
            "rollout.num_generations=2",
            "rollout.max_tokens=4",
            f"output_dir={tmp_path / 'grpo'}",
        ],
    )
    with pytest.raises(ValueError, match="needs 4 distinct prompts per step, but the prompt set has 3"):
        run_grpo(cfg, progress=False)
    _reset_accelerate()


def test_resuming_with_another_model_says_the_model_differs(tmp_path):
    import transformers

    from nopad.recipes.tiny_model import AsciiTokenizer

    out = tmp_path / "run"
    small = [
        "data.num_rows=8",
        "data.max_len=20",
        "data.tokens_per_batch=64",
        "train.progress=false",
        "train.max_steps=1",
        "train.grad_accum=1",
        f"checkpoint.output_dir={out}",
    ]
    train(load_config(SFTConfig, None, ["model.path=tiny:llama", *small]))
    _reset_accelerate()
    other = tmp_path / "other"
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    AsciiTokenizer().save_pretrained(other)
    with pytest.raises(RuntimeError, match="was written for a different model than model.path"):
        train(
            load_config(
                SFTConfig, None, [f"model.path={other}", *small, "train.max_steps=2", "checkpoint.resume_from=latest"]
            )
        )
    _reset_accelerate()


@pytest.mark.parametrize(
    "module, override, message",
    [
        (
            "nopad.recipes.grpo",
            "rollout.temperature=-1",
            "rollout.temperature must be a finite number >= 0 (0 = greedy), got -1.0",
        ),
        ("nopad.recipes.grpo", "rollout.top_p=0", "rollout.top_p must be in (0, 1] (1 disables it), got 0.0"),
        ("nopad.recipes.grpo", "rollout.top_p=1.5", "rollout.top_p must be in (0, 1] (1 disables it), got 1.5"),
        ("nopad.recipes.evaluate", "sampling.temperature=-1", "sampling.temperature must be a finite number >= 0"),
        ("nopad.recipes.evaluate", "sampling.top_p=0", "sampling.top_p must be in (0, 1]"),
        ("nopad.recipes.evaluate", "sampling.temperature=.nan", "sampling.temperature must be a finite number >= 0"),
        ("nopad.recipes.evaluate", "sampling.max_tokens=0", "sampling.max_tokens must be >= 1, got 0"),
    ],
)
def test_sampling_settings_are_checked_when_the_config_is_built(module, override, message, capsys):
    """By the generator's own rule (SamplingParams), before any model loads."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main([override, "model.path=/nonexistent/model"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{module}: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize("files", [[], ["tokenizer_config.json"]])
def test_a_model_directory_without_tokenizer_files_says_which_were_looked_for(tmp_path, files):
    """Transformers used to end in "install sentencepiece or tiktoken", which was not the cause."""
    from nopad.recipes.tiny_model import tiny_causal_lm

    tiny_causal_lm("llama")[0].save_pretrained(tmp_path)
    for name in files:
        (tmp_path / name).write_text("{}")
    alone = " (tokenizer_config.json alone holds no vocabulary)" if files else ""
    with pytest.raises(FileNotFoundError) as err:
        load_model(ModelConfig(path=str(tmp_path)))
    assert str(err.value) == (
        f"model.path={tmp_path} holds no tokenizer files{alone}: looked for "
        "tokenizer.json, *.model, vocab.json, vocab.txt, *.tiktoken; copy the "
        "tokenizer files of the model it came from into it (or write them there with "
        "tokenizer.save_pretrained)"
    )
