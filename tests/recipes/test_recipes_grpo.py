"""GRPO recipe: config validation, advantages, rollout packing, the loss, and one live step."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from nopad.recipes.config import ConfigError, load_config, parse_override, with_overrides
from nopad.recipes.grpo import DEFAULT_CONFIG, GRPORecipeConfig, run_grpo
from nopad.recipes.tasks import (
    arithmetic_task,
    exact_match,
    get_reward,
    last_number_match,
)
from nopad.recipes.tiny_model import AsciiTokenizer
from nopad.training.grpo import Rollout, group_advantages, pack_rollouts, pair_advantages
from tests.support import launch


def config(**overrides) -> GRPORecipeConfig:
    return load_config(GRPORecipeConfig, overrides=[f"{k}={v}" for k, v in overrides.items()])


# ----------------------------------------------------------------------------- config
def test_overrides_parse_yaml_values_and_nest():
    assert parse_override("train.lr=1e-5") == {"train": {"lr": 1e-5}}
    assert parse_override("task.prompts=null") == {"task": {"prompts": None}}
    cfg = config(
        **{"rollout.num_generations": 8, "loss.is_correction": "token_truncate", "train.old_logprobs": "recompute"}
    )
    assert cfg.rollout.num_generations == 8
    assert cfg.loss.is_correction == "token_truncate"
    assert cfg.rollout.max_tokens == 48  # untouched defaults survive
    assert config(**{"train.lr": 1}).train.lr == 1.0 and isinstance(config(**{"train.lr": 1}).train.lr, float)


def test_the_shipped_yaml_lists_exactly_the_defaults():
    """recipes/configs/grpo.yaml is the commented copy of GRPORecipeConfig's defaults: loading it changes
    nothing, so the two cannot drift."""
    assert load_config(GRPORecipeConfig, DEFAULT_CONFIG) == GRPORecipeConfig()


def test_typed_config_checks_values_in_python_too():
    from nopad.recipes.grpo_config import GRPOTrainConfig, RolloutConfig

    with pytest.raises(ConfigError, match=r"^num_generations must be an integer >= 2, got 1"):
        RolloutConfig(num_generations=1)
    with pytest.raises(ConfigError, match=r"^batch_invariant must be true, false or 'auto', got 'yes'"):
        GRPOTrainConfig(batch_invariant="yes")
    cfg = GRPORecipeConfig(rollout={"max_tokens": 8})  # a section given as a mapping becomes its dataclass
    assert isinstance(cfg.rollout, RolloutConfig) and cfg.rollout.max_tokens == 8
    with pytest.raises(ConfigError, match=r"^train.steps must be an integer, got 'two'"):
        with_overrides(cfg, ["train.steps=two"])
    assert with_overrides(cfg, {"train": {"steps": 5}}).train.steps == 5 and cfg.train.steps == 2
    assert config(output_dir=2024).output_dir == "2024"  # a directory name YAML reads as a number


def test_the_rollout_modes_are_the_ones_inference_runs():
    import typing

    from nopad.inference.sharded import ROLLOUT_MODES
    from nopad.recipes.grpo_config import GRPOGeneratorConfig

    assert typing.get_args(typing.get_type_hints(GRPOGeneratorConfig)["sharded_rollout"]) == ROLLOUT_MODES


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"rollout.max_token is not a config key.*known keys"):
        config(**{"rollout.max_token": 8})
    with pytest.raises(ValueError, match="section.key=value"):
        parse_override("train.steps")


def test_missing_model_path_fails_fast(tmp_path):
    with pytest.raises(ValueError, match=r"model.path is missing: set model.path=smollm2"):
        run_grpo(config(**{"model.path": "null", "output_dir": tmp_path}))
    with pytest.raises(FileNotFoundError, match=r"model.path='/no/such/dir' is not a directory"):
        run_grpo(config(**{"model.path": "/no/such/dir", "output_dir": tmp_path}))


def test_a_run_that_would_save_nothing_or_an_untrained_copy_is_refused(tmp_path):
    """Without output_dir the recipe used to train and saved nothing; train.steps=0 saved the
    untouched model as the policy."""
    with pytest.raises(ConfigError, match=r"output_dir is required: the trained policy is saved there"):
        run_grpo(config(**{"model.path": "tiny:llama"}))
    with pytest.raises(ConfigError, match=r"train.steps must be an integer >= 1, got 0"):
        config(**{"train.steps": 0, "output_dir": tmp_path})


def test_batch_larger_than_cache_fails_fast():
    # 64 sequences of up to 64 + 16 tokens = 5 blocks each = 320 blocks > 64
    with pytest.raises(ValueError) as err:
        config(
            **{
                "rollout.prompts_per_step": 8,
                "rollout.num_generations": 8,
                "rollout.max_tokens": 16,
                "generator.num_blocks": 64,
            }
        )
    msg = str(err.value)
    assert "larger than the KV cache" in msg
    assert "need 320 blocks of 16, but generator.num_blocks=64" in msg
    assert "raise generator.num_blocks" in msg


def test_unknown_reward_fails_fast_with_choices():
    with pytest.raises(ValueError, match=r"unknown reward 'exactly'.*exact_match.*module:function"):
        config(reward="exactly")
    with pytest.raises(ValueError, match=r"reward='no_such_module:fn': cannot import"):
        config(reward="no_such_module:fn")
    with pytest.raises(ValueError, match=r"loss.is_correction 'tiss' is unknown"):
        config(**{"loss.is_correction": "tiss"})


def test_other_bad_settings_name_the_key():
    with pytest.raises(ValueError, match=r"rollout.num_generations must be an integer >= 2, got 1"):
        config(**{"rollout.num_generations": 1})
    with pytest.raises(ValueError, match=r"train.max_tokens_per_batch=32 is smaller than one rollout"):
        config(**{"train.max_tokens_per_batch": 32})
    with pytest.raises(ValueError, match=r"task.name 'algebra' is not a built-in task"):
        config(**{"task.name": "algebra"})


# ----------------------------------------------------------------------------- task and rewards
def test_arithmetic_task_is_deterministic_and_correct():
    a, b = arithmetic_task(50, seed=3), arithmetic_task(50, seed=3)
    assert a == b and len(a) == 50
    for ex in a:
        x, op, y = ex["prompt"].removeprefix("What is ").split("?")[0].split()
        assert ex["answer"] == str(eval(f"{x}{op}{y}"))  # noqa: S307 - our own generated digits
        assert int(ex["answer"]) >= 0
    assert arithmetic_task(50, seed=4) != a


def test_rewards():
    ex = {"answer": "19"}
    assert exact_match(" 19\n", ex) == 1.0
    assert exact_match("19.", ex) == 0.0
    assert last_number_match("The answer is 19.", ex) == 1.0
    assert last_number_match("7 + 12 = 19", ex) == 1.0
    assert last_number_match("19 - 7 = 12", ex) == 0.0
    assert last_number_match("no digits", ex) == 0.0
    assert get_reward("tests.recipes.test_recipes_grpo:length_reward")("abc", ex) == 3.0
    with pytest.raises(KeyError, match="needs an 'answer' field"):
        exact_match("19", {"prompt": "x"})


def length_reward(completion: str, example: dict) -> float:
    return float(len(completion))


# ----------------------------------------------------------------------------- advantages and loss
def test_group_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]) / torch.tensor([[std + 1e-4], [1e-4]])
    torch.testing.assert_close(adv, expected)
    with pytest.raises(ValueError, match="num_generations >= 2"):
        group_advantages(torch.ones(3, 1))


def test_pack_rollouts_masks_prompts_and_aligns_per_token_data():
    rollouts = [
        Rollout([10, 11, 12], [20, 21], [-0.1, -0.2], advantage=1.0),
        Rollout([13], [22, 23, 24], [-0.3, -0.4, -0.5], advantage=-2.0),
        Rollout([14, 15, 16, 17, 18], [25], [-0.6], advantage=0.5),
    ]
    rows = pack_rollouts(rollouts, capacity=8)
    assert sum(r["num_loss_tokens"] for r in rows) == 6
    seen = {}
    for row in rows:
        ids, labels = row["input_ids"][0].tolist(), row["labels"][0].tolist()
        meta = row["nopad_meta"]
        assert sum(meta.seqlens_q) == len(ids) <= 8
        loss_at = [t for t, lab in enumerate(labels) if lab != -100]
        assert [labels[t] for t in loss_at] == [ids[t] for t in loss_at]
        gen_logprobs, advantages = row.token_values["gen_logprobs"], pair_advantages(row, rollouts)
        assert len(loss_at) == len(gen_logprobs) == len(advantages)
        for t, lp, a in zip(loss_at, gen_logprobs.tolist(), advantages.tolist()):
            seen[ids[t]] = (round(lp, 4), a)
    assert seen == {
        20: (-0.1, 1.0),
        21: (-0.2, 1.0),
        22: (-0.3, -2.0),
        23: (-0.4, -2.0),
        24: (-0.5, -2.0),
        25: (-0.6, 0.5),
    }


def test_ascii_tokenizer_round_trips():
    tok = AsciiTokenizer()
    ids = tok.encode("What is 2 + 3?")
    assert ids[:4] == [87, 104, 97, 116]
    assert tok.decode(ids + [2]) == "What is 2 + 3?"
    with pytest.raises(ValueError, match="only encodes characters below 128"):
        tok.encode("é")


# ----------------------------------------------------------------------------- live steps
def ids_checksum_reward(completion: str, example: dict) -> float:
    """A reward that varies between random completions, so advantages are non-zero."""
    return float(sum(map(ord, completion)) % 5)


def tiny_config(**overrides):
    base = {
        "model": {"path": None, "chat_template": False},
        "reward": "tests.recipes.test_recipes_grpo:ids_checksum_reward",
        "task": {"num_prompts": 8},
        "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_tokens": 8},
        "generator": {"num_blocks": 64, "max_num_batched_tokens": 256},
        "train": {"steps": 1, "lr": 1e-3},
    }
    return with_overrides(load_config(GRPORecipeConfig, overrides=base), overrides)


@pytest.fixture()
def policy():
    torch.set_num_threads(1)
    from tests.support.models import tiny_model

    return tiny_model("llama")


def test_packed_logprobs_match_unpacked_forwards(policy):
    from nopad.packing.hf import use_nopad_attention
    from nopad.training.grpo import packed_logprobs

    g = torch.Generator().manual_seed(0)
    rollouts = [
        Rollout(torch.randint(3, 128, (p,), generator=g).tolist(), torch.randint(3, 128, (c,), generator=g).tolist())
        for p, c in [(5, 3), (2, 6), (7, 1), (3, 4)]
    ]
    rows = pack_rollouts(rollouts, capacity=16)
    assert len(rows) == 2
    expected = {}
    with torch.no_grad():
        for r in rollouts:  # each sequence alone through the model's own (sdpa) attention
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logp = torch.log_softmax(policy(ids).logits[0].float(), -1)
            for k, tok in enumerate(r.completion_ids):
                expected[(tuple(r.prompt_ids), k)] = float(logp[len(r.prompt_ids) + k - 1, tok])
        got = []
        with use_nopad_attention(policy):
            for row in rows:
                got += packed_logprobs(policy, row).tolist()
    order = [
        (tuple(rollouts[i].prompt_ids), k)
        for row in rows
        for i in row["indices"].tolist()
        for k in range(len(rollouts[i].completion_ids))
    ]
    torch.testing.assert_close(torch.tensor(got), torch.tensor([expected[o] for o in order]), atol=1e-5, rtol=0)


def test_one_grpo_step_on_the_live_model(policy):
    from accelerate import Accelerator

    from nopad.inference import Generator
    from nopad.packing.hf import use_nopad_attention
    from nopad.recipes.grpo import build_prompts, grpo_loss
    from nopad.recipes.grpo_rollouts import sampling_params
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo_step import grpo_step

    cfg = tiny_config()
    tok = AsciiTokenizer()
    examples, prompt_ids = build_prompts(cfg, tok)
    gen = Generator(policy, block_size=16, num_blocks=64, max_num_batched_tokens=256)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    kv_alive_at_backward = []
    policy.lm_head.weight.register_hook(lambda grad: kv_alive_at_backward.append(gen._kv_cache is not None))
    stepper = OptimizerStepper(policy, optimizer, Accelerator(cpu=True), cfg.train.max_grad_norm)
    with use_nopad_attention(policy):
        metrics = grpo_step(
            stepper,
            gen,
            examples[:2],
            prompt_ids[:2],
            get_reward(cfg.reward),
            tok,
            sampling_params(cfg, 0),
            grpo_loss(cfg, policy.device),
        )
    assert kv_alive_at_backward == [False]  # one packed row, KV cache already handed back
    assert gen._kv_cache is None and gen.stats()["steps"] > 0
    assert metrics["completion_tokens"] > 0 and metrics["train_rows"] == 1
    # prefix-tree rows (the default): each prompt once, not once per completion (and completions'
    # common starts once too)
    assert metrics["train_tokens"] <= sum(map(len, prompt_ids[:2])) + metrics["completion_tokens"]
    n = sampling_params(cfg, 0).n  # completions per prompt
    assert metrics["flat_train_tokens"] == n * sum(map(len, prompt_ids[:2])) + metrics["completion_tokens"]
    assert metrics["tree_token_saving"] == 1 - metrics["train_tokens"] / metrics["flat_train_tokens"] > 0
    assert metrics["padded_train_tokens"] >= metrics["train_tokens"]
    # batch-invariant mode (the default on CPU): the rollouts are exactly the trained policy's
    assert metrics["batch_invariant"] == 1.0
    assert metrics["logprob_gap_max"] == 0.0 and metrics["is_ratio_min"] == metrics["is_ratio_max"] == 1.0
    assert metrics["reward_std"] > 0 and metrics["grad_norm"] > 0
    changed = [name for name, p in policy.named_parameters() if not torch.equal(p, before[name])]
    assert len(changed) == len(before)
    assert set(metrics) == {
        "step",
        "reward_mean",
        "reward_std",
        "loss",
        "grad_norm",
        "clip_fraction",
        "completion_tokens",
        "rollout_tokens_per_s",
        "train_tokens",
        "train_rows",
        "padded_train_tokens",
        "flat_train_tokens",
        "tree_token_saving",
        "train_tokens_per_s",
        "logprob_gap_max",
        "logprob_gap_mean",
        "rollout_s",
        "train_s",
        "is_ratio_min",
        "is_ratio_max",
        "batch_invariant",
        "mismatch/outside_band",
        "mismatch/ratio_dev_p95",
        "mismatch/ratio_dev_max",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "optimizer_steps",
        "forwards_per_optimizer_step",
        "ratio_dev_max_first_step",
        "ratio_dev_max",
    }
    assert metrics["optimizer_steps"] == 1 and metrics["forwards_per_optimizer_step"] == 1
    assert metrics["mismatch/ratio_dev_max"] == 0.0


def test_run_grpo_with_tis_and_kl_writes_metrics(policy, tmp_path):
    from nopad.recipes.grpo import run_grpo

    cfg = tiny_config(
        train={"steps": 2, "old_logprobs": "recompute"},
        output_dir=str(tmp_path),
        loss={"is_correction": "token_truncate", "is_clip_max": 2.0, "beta": 0.1},
    )
    history = run_grpo(cfg, model=policy, tokenizer=AsciiTokenizer(), progress=False)
    assert [h["step"] for h in history] == [0, 1]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == history
    assert all(h["logprob_gap_max"] == 0.0 for h in history)
    assert all(h["kl"] >= 0.0 and h["mismatch/is/tokens_touched"] == 0.0 for h in history)
    assert policy.config._attn_implementation == "sdpa"  # the recipe restores the model's setting
    # the trained policy is an HF model directory that transformers and the recipes load
    from transformers import AutoModelForCausalLM

    from nopad.recipes.models import load_model

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), policy.state_dict().values()))
    from nopad.recipes.config import ChatModelConfig

    _, tok = load_model(ChatModelConfig(path=str(tmp_path)))
    assert isinstance(tok, AsciiTokenizer)


def test_is_correction_typo_names_its_own_choices():
    with pytest.raises(ValueError, match="loss.is_correction 'foo' is unknown; use none or one of"):
        config(**{"loss.is_correction": "foo"})


def test_default_config_is_the_demo_shape():
    cfg = config()
    ro = cfg.rollout  # (built and checked: it fits the default KV cache)
    assert (ro.prompts_per_step, ro.num_generations, ro.max_tokens) == (8, 8, 48)


def test_a_step_where_every_group_scores_the_same_warns(policy, caplog):
    from nopad.recipes.grpo import run_grpo

    cfg = tiny_config(reward="tests.recipes.test_recipes_grpo:zero_reward")
    with caplog.at_level(logging.WARNING, logger="nopad.training.grpo_step"):
        history = run_grpo(cfg, model=policy, tokenizer=AsciiTokenizer(), progress=False)
    assert history[0]["grad_norm"] == 0.0
    assert any("every group's rewards are equal" in r.getMessage() for r in caplog.records)


def zero_reward(completion: str, example: dict) -> float:
    return 0.0


TWO_RANK_SCRIPT = """
import json, sys, torch
from nopad.recipes.config import load_config
from nopad.recipes.models import load_model
from nopad.recipes.grpo import GRPORecipeConfig, run_grpo
cfg = load_config(GRPORecipeConfig, overrides=sys.argv[2:])
model, tok = load_model(cfg.model)
before = [p.detach().clone() for p in model.parameters()]
history = run_grpo(cfg, model=model, tokenizer=tok, progress=False)
rank = torch.distributed.get_rank()
params = [p.detach().double().sum().item() for p in model.parameters()]
changed = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"history": history, "params": params, "changed": changed}, f)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)  # the launch's own 600 s, then a margin
def test_two_processes_keep_identical_weights(tmp_path):
    import os
    import sys

    script = tmp_path / "run.py"
    script.write_text(TWO_RANK_SCRIPT)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    overrides = [
        "model.path=tiny:llama",
        "model.chat_template=false",
        "reward=tests.recipes.test_recipes_grpo:ids_checksum_reward",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_tokens=8",
        "generator.num_blocks=64",
        "train.steps=2",
        "train.lr=1e-3",
    ]
    launch.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(launch.free_port()),
            str(script),
            str(tmp_path),
            *overrides,
        ],
        what="GRPO on 2 processes",
        env=env,
        timeout=600,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["params"] == ranks[1]["params"]  # gradients all-reduced: one model on both ranks
    assert ranks[0]["changed"] == ranks[1]["changed"] > 0
    for r in ranks:
        assert [h["step"] for h in r["history"]] == [0, 1]
        assert all(h["logprob_gap_max"] <= 1e-5 for h in r["history"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grpo_step_is_exactly_on_policy_in_bf16_too(dtype, one_thread):
    """The point of sharing one core: in bf16 the default numerics gave gaps of ~1e-3 here; in the
    batch-invariant mode every token's importance ratio is exactly 1. Off, the gap is reported."""
    from accelerate import Accelerator

    from nopad.inference import Generator
    from nopad.packing.hf import use_nopad_attention
    from nopad.recipes.grpo import build_prompts, grpo_loss
    from nopad.recipes.grpo_rollouts import sampling_params
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo_step import grpo_step
    from tests.support.models import tiny_model

    tok = AsciiTokenizer()
    for invariant in (True, False):
        policy = tiny_model("qwen2").to(dtype)
        cfg = tiny_config(train={"batch_invariant": invariant})
        examples, prompt_ids = build_prompts(cfg, tok)
        gen = Generator(policy, block_size=16, num_blocks=64, max_num_batched_tokens=40)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
        stepper = OptimizerStepper(policy, optimizer, Accelerator(cpu=True), cfg.train.max_grad_norm)
        with use_nopad_attention(policy):
            m = grpo_step(
                stepper,
                gen,
                examples[:3],
                prompt_ids[:3],
                get_reward(cfg.reward),
                tok,
                sampling_params(cfg, 0),
                grpo_loss(cfg, policy.device),
            )
        assert m["batch_invariant"] == float(invariant)
        if invariant:
            assert m["logprob_gap_max"] == 0.0 and m["is_ratio_min"] == m["is_ratio_max"] == 1.0
        else:
            assert m["logprob_gap_max"] > 0.0


def test_batch_invariant_setting_is_checked():
    with pytest.raises(ValueError, match="train.batch_invariant must be true, false or 'auto'"):
        tiny_config(train={"batch_invariant": "yes"})


def test_recipe_and_trl_trainer_score_rollouts_through_the_one_shared_function(monkeypatch):
    """The GRPO recipe's training forward (pack_rollouts + packed_logprobs) and NopadGRPOTrainer's
    (TRL's padded batch -> the same two functions) give the same log-probs, bitwise."""
    import nopad.training.grpo
    from nopad.packing.hf import use_nopad_attention
    from nopad.packing.invariance import batch_invariant
    from nopad.training.grpo import packed_logprobs
    from nopad.training.trl.grpo_trainer import packed_completion_logprobs
    from tests.support.models import tiny_model

    model = tiny_model("qwen2")
    prompts = [[5, 6, 7], [5, 6, 7], [9, 3]]
    completions = [[11, 12], [13, 14, 15], [16]]
    rollouts = [Rollout(p, c) for p, c in zip(prompts, completions)]
    # TRL's layout: left-padded prompts | right-padded completions
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(3, width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, width_p - len(p) : width_p], mask[b, width_p - len(p) : width_p] = torch.tensor(p), 1
        ids[b, width_p : width_p + len(c)], mask[b, width_p : width_p + len(c)] = torch.tensor(c), 1
    calls = []
    monkeypatch.setattr(
        nopad.training.trl.grpo_trainer,
        "packed_logprobs",
        lambda *a, **k: calls.append(1) or nopad.training.grpo.packed_logprobs(*a, **k),
    )
    with use_nopad_attention(model), torch.no_grad(), batch_invariant():
        recipe = {}
        for row in pack_rollouts(rollouts, capacity=64):
            scored = packed_logprobs(model, row).split([len(completions[i]) for i in row["indices"].tolist()])
            recipe.update(zip(row["indices"].tolist(), scored))
        trainer, _ = packed_completion_logprobs(model, ids, mask, width_c)
    assert calls  # the trainer went through the shared function
    for b, c in enumerate(completions):
        assert torch.equal(trainer[b, : len(c)], recipe[b])


def test_a_yaml_file_with_exponent_numbers_and_nested_sections(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("train:\n  lr: 1e-5\n  steps: 3\nrollout:\n  max_tokens: 16\n")  # YAML 1.1: 1e-5 is a str
    cfg = load_config(GRPORecipeConfig, path, ["train.steps=4"])
    assert (cfg.train.lr, cfg.train.steps, cfg.rollout.max_tokens) == (1e-5, 4, 16)
    path.write_text("train: 3\n")
    with pytest.raises(ConfigError, match=r"^train is a section; set its fields as train.<field>=\.\.\."):
        load_config(GRPORecipeConfig, path)
