"""LoRA as users run it: ``model.lora`` in the SFT and GRPO recipes, adapter-only checkpoints
that evaluate and GRPO take as ``model.path``, exact resume, rollouts bitwise equal to the trainer's
under ``nopad.packing.batch_invariant``, and a 2-process DeepSpeed ZeRO-3 run (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nopad.recipes.config import ChatModelConfig, ConfigError, load_config
from nopad.recipes.evaluate import EvaluateConfig, run_evaluate
from nopad.recipes.grpo import run_grpo
from nopad.recipes.grpo_config import GRPORecipeConfig
from nopad.recipes.models import load_model
from nopad.recipes.sft import train
from nopad.recipes.sft_config import SFTRecipeConfig
from nopad.training.lora import is_peft_model
from tests.recipes.test_recipes_sft import SMALL, _reset_accelerate

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
TINY_GRPO = [
    "task.num_prompts=4",
    "rollout.prompts_per_step=2",
    "rollout.num_generations=2",
    "rollout.max_tokens=4",
    "generator.num_blocks=64",
    "train.steps=1",
    "train.lr=1e-3",
    "model.chat_template=false",
    "reward=tests.recipes.test_recipes_grpo:ids_checksum_reward",
]


def replaced(settings: list[str], *new: str) -> list[str]:
    """``settings`` with the keys of ``new`` given the new values (a key is given once on a command line)."""
    keys = {s.split("=", 1)[0] for s in new}
    return [s for s in settings if s.split("=", 1)[0] not in keys] + list(new)


def _sft(out: Path, *extra) -> dict:
    cfg = load_config(SFTRecipeConfig, None, [*SMALL, *LORA, f"checkpoint.output_dir={out}", *extra])
    result = train(cfg)
    _reset_accelerate()
    return result


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_sft")
    return out, _sft(out, "train.max_steps=2")


def test_sft_with_lora_writes_the_adapter_alone_and_what_loads_it(sft_run):
    out, result = sft_run
    step = Path(result["checkpoint"])
    names = {p.name for p in step.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "nopad_ascii_tokenizer.json"} <= names
    assert not names & {"model.safetensors", "config.json"}  # no copy of the base
    config = json.loads((step / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny:llama" and config["r"] == 4
    adapter = load_file(str(step / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # it trained
    resume_state = load_file(str(step / "training_state" / "model.safetensors"))
    assert sorted(resume_state) and all("lora_" in k for k in resume_state)  # the resume state too
    # model.path = the run directory: its newest checkpoint, the adapter merged into its base
    model, tok = load_model(ChatModelConfig(path=str(out)))
    base, _ = load_model(ChatModelConfig(path="tiny:llama"))
    assert not is_peft_model(model) and tok("hi")["input_ids"] == [104, 105]
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert any("q_proj" in n for n in moved) and not any("embed" in n for n in moved)


def test_evaluate_and_grpo_take_the_adapter_as_model_path(sft_run, tmp_path):
    out, _ = sft_run
    result = run_evaluate(
        load_config(
            EvaluateConfig,
            None,
            [
                f"model.path={out}",
                "data.num_prompts=2",
                "sampling.max_tokens=4",
                "output=null",
                "model.chat_template=false",
            ],
        ),
        progress=False,
    )
    assert result["num_prompts"] == 2 and result["completion_tokens"] > 0
    # with model.lora: the adapter trains further and the output is an adapter on the same base
    run_grpo(
        load_config(
            GRPORecipeConfig, None, [f"model.path={out}", *LORA, *TINY_GRPO, f"output_dir={tmp_path / 'adapter'}"]
        ),
        progress=False,
    )
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny:llama"
    assert not (tmp_path / "adapter" / "config.json").exists()
    # without: the merged model is fine-tuned in full and saved whole
    run_grpo(
        load_config(GRPORecipeConfig, None, [f"model.path={out}", *TINY_GRPO, f"output_dir={tmp_path / 'full'}"]),
        progress=False,
    )
    assert (tmp_path / "full" / "config.json").is_file()
    # other LoRA settings than the adapter's are an error naming them, not a silent choice
    with pytest.raises(ConfigError, match=r"model.lora.rank=8 but the adapter has 4"):
        load_model(load_config(GRPORecipeConfig, None, [f"model.path={out}", "model.lora.alpha=8"]).model)


def test_an_adapter_whose_base_is_not_there_says_so(sft_run, tmp_path):
    out, result = sft_run
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    step = Path(result["checkpoint"])
    config = json.loads((step / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/gone/base"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes((step / "adapter_model.safetensors").read_bytes())
    with pytest.raises(
        FileNotFoundError,
        match=r"LoRA adapter for the base model '/gone/base', which is not "
        r"here .*base_model_name_or_path",
    ):
        load_model(ChatModelConfig(path=str(adapter)))


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match=r"^model.lora.rank must be an integer >= 1, got 0"):
        load_config(SFTRecipeConfig, None, ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"^model.lora.dropout must be a number in \[0, 1\)"):
        load_config(GRPORecipeConfig, None, ["model.lora.dropout=1"])
    cfg = load_config(SFTRecipeConfig, None, ["model.path=tiny:llama", "model.lora.target_modules=q_proj,qkv"])
    assert cfg.model.lora.targets == ["q_proj", "qkv"]
    with pytest.raises(
        ValueError,
        match=r"target_modules: qkv not found in the model; its linear layers are "
        r".*q_proj",
    ):
        load_model(cfg.model)
    assert load_config(SFTRecipeConfig).model.lora is None  # off unless asked for


@pytest.mark.parametrize(
    "change, message",
    [
        ("model.lora.target_modules=q_proj", r"model.lora.target_modules=\['q_proj'\] but the adapter has \["),
        ("model.lora.alpha=3", "model.lora.alpha=3.0 but the adapter has 8"),  # would load, as another model
        ("model.lora.rank=2", "model.lora.rank=2 but the adapter has 4"),
        ("model.lora=null", r"model.lora is null, but checkpoint .*step_2 holds a LoRA adapter \(rank=4, "),
    ],
)
def test_resuming_with_a_changed_lora_setting_names_it(sft_run, change, message):
    """The setting that changed, not "written for a different model" and a state-dict dump."""
    out, _ = sft_run
    with pytest.raises(ConfigError, match=message):
        _sft(out, "train.max_steps=3", "checkpoint.resume_from=latest", change)
    _reset_accelerate()


def test_resume_with_lora_gives_the_uninterrupted_run(tmp_path):
    full = _sft(tmp_path / "full", "train.max_steps=3")
    _sft(tmp_path / "cut", "train.max_steps=2")
    rest = _sft(tmp_path / "cut", "train.max_steps=3", "checkpoint.resume_from=latest")
    assert rest["losses"] == full["losses"][2:]
    a = load_file(str(tmp_path / "full" / "step_3" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "step_3" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the optimizer holds the adapter's state alone
    state = tmp_path / "cut" / "step_2" / "training_state"
    optimizer = torch.load(state / "optimizer.bin", weights_only=True)
    assert len(optimizer["state"]) == len(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_rollouts_equal_the_trainers_logprobs_bitwise_under_batch_invariant(dtype, one_thread):
    """The adapter's layers are nn.Linear, so the exact mode covers them: every sampled token's
    rollout log-prob equals the LoRA training forward's. Off, the gap is there to see."""
    from accelerate import Accelerator

    from nopad.inference import Generator
    from nopad.packing.hf import use_nopad_attention
    from nopad.recipes.grpo import build_prompts, grpo_loss
    from nopad.recipes.grpo_rollouts import sampling_params
    from nopad.recipes.tasks import get_reward
    from nopad.recipes.tiny_model import AsciiTokenizer
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo_step import grpo_step
    from nopad.training.lora import apply_lora, trainable_parameters
    from tests.recipes.test_recipes_grpo import tiny_config
    from tests.support.models import tiny_model

    tok = AsciiTokenizer()
    for invariant in (True, False):
        base = tiny_model("llama").to(dtype)
        policy = apply_lora(base, rank=4, alpha=8, dropout=0.0, target_modules="all-linear", base="tiny:llama")
        with torch.no_grad():  # a trained adapter: lora_B away from its zero start
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
        cfg = tiny_config(train={"batch_invariant": invariant})
        examples, prompt_ids = build_prompts(cfg, tok)
        gen = Generator(policy, block_size=16, num_blocks=64, max_num_batched_tokens=40)
        optimizer = torch.optim.SGD(trainable_parameters(policy), lr=1e-3)
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
        if invariant:
            assert m["logprob_gap_max"] == 0.0 and m["is_ratio_min"] == m["is_ratio_max"] == 1.0
            assert m["grad_norm"] > 0  # the adapter trained on those rows
        elif dtype == torch.bfloat16:
            assert m["logprob_gap_max"] > 0.0  # what the mode removes


# ---------------------------------------------------------------------------------- 2 processes
@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory) -> Path:
    """The three LoRA runs under ZeRO-3 in one 2-process launch (tests.support.recipe_runs: one
    start-up instead of three): SFT with a checkpoint per step, SFT resumed from its step_1 on a fresh
    model and Accelerate state, and GRPO."""
    from tests.training.test_training_sharded import ROOT, TIMEOUT_S, _run_two_ranks

    out = tmp_path_factory.mktemp("lora_zero3")
    zero3 = f"accelerate.deepspeed_config={ROOT / 'recipes/configs/deepspeed_zero3.json'}"
    sft = ["sft", *SMALL, *LORA, "train.grad_accum=4", "train.max_steps=2", zero3]  # 1 step/epoch
    runs = [
        [*sft, f"checkpoint.output_dir={out / 'z3'}", "checkpoint.every=1"],
        [*sft, f"checkpoint.output_dir={out / 'z3r'}", f"checkpoint.resume_from={out / 'z3' / 'step_1'}"],
        [
            "grpo",
            "model.path=tiny:llama",
            *LORA,
            *replaced(TINY_GRPO, "train.steps=2", "rollout.prompts_per_step=1"),
            f"output_dir={out / 'grpo'}",
            zero3,
        ],
    ]
    _run_two_ranks(
        ["-m", "tests.support.recipe_runs", *runs[0], "--", *runs[1], "--", *runs[2]],
        "LoRA SFT, SFT resume and GRPO under ZeRO-3",
        timeout=3 * TIMEOUT_S,
    )
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)  # the fixture's 450 s launch
def test_lora_under_deepspeed_zero3_matches_one_process_and_resumes(zero3_runs, tmp_path):
    """Two CPU ranks over gloo: the adapter partitioned by ZeRO-3 trains as in one process (the
    same first-step loss and update), its checkpoint is the adapter alone, and a resume from step 1
    gives the uninterrupted run's step 2."""
    one = _sft(tmp_path / "one", "train.grad_accum=6", "train.max_steps=2", "checkpoint.every=1")  # 6 bins
    z3 = [json.loads((zero3_runs / "z3" / f"result_rank{r}.json").read_text()) for r in range(2)]
    assert z3[0]["zero_stage"] == 3 and z3[0]["losses"] == z3[1]["losses"]
    assert z3[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    resumed = json.loads((zero3_runs / "z3r" / "result_rank0.json").read_text())
    assert resumed["losses"] == z3[0]["losses"][1:]
    for step in (1, 2):
        names = {p.name for p in (zero3_runs / "z3" / f"step_{step}").iterdir()}
        assert "adapter_model.safetensors" in names and "config.json" not in names
        got = load_file(str(zero3_runs / "z3" / f"step_{step}" / "adapter_model.safetensors"))
        want = load_file(str(tmp_path / "one" / f"step_{step}" / "adapter_model.safetensors"))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the fixture's 450 s launch
def test_lora_grpo_under_deepspeed_zero3_saves_the_adapter(zero3_runs):
    """GRPO's rollout gathers the ZeRO-3 shards of base and adapter alike; the run stays on-policy
    (to the bound the other sharded runs meet: ZeRO-3's own linear is not the exact mode's) and
    writes the adapter alone, which model.path loads."""
    out = zero3_runs / "grpo"
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all(h["logprob_gap_max"] <= 1e-5 for h in history)
    names = {p.name for p in out.iterdir()}
    assert "adapter_model.safetensors" in names and "config.json" not in names
    model, _ = load_model(ChatModelConfig(path=str(out)))
    assert not is_peft_model(model)


def test_nopad_grpo_trainer_with_a_peft_config_is_exactly_on_policy(tmp_path, one_thread):
    """``NopadGRPOTrainer(peft_config=...)``: TRL wraps the model in peft; the rollout's log-probs,
    TRL's old log-probs and the loss forward's are the same bits, and only the adapter moves."""
    pytest.importorskip("trl")
    from peft import LoraConfig

    from nopad.training.trl.rollout import nopad_rollout_func
    from tests.training.test_training_trl import _grpo, logp_recorder, make_tokenizer

    seen = []

    class Recording(logp_recorder(seen)):
        def __init__(self, *args, **kwargs):
            super().__init__(
                *args,
                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
                **kwargs,
            )

    rollout = nopad_rollout_func(importance_sampling=True, batch_invariant=True, max_num_batched_tokens=64)
    trainer = _grpo(
        make_tokenizer(), tmp_path, rollout, cls=Recording, batch_invariant=True, max_steps=1, max_completion_length=8
    )
    assert is_peft_model(trainer.model)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    inputs, current = seen[0]
    mask = inputs["completion_mask"].bool()
    sampled, old = inputs["sampling_per_token_logps"][mask], inputs["old_per_token_logps"][mask]
    assert torch.equal(sampled, old) and torch.equal(current[mask], old) and mask.sum() > 8
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)
