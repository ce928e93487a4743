"""Sharded engines (DeepSpeed ZeRO-3, FSDP2) on 2 CPU processes over gloo (slow): GRPO with very
different rollout lengths per rank and a rank without prompts ends, one optimizer step per GRPO
step, the weights of DDP; greedy rollouts equal the unsharded model's; packed SFT gradients equal
unpacked single-process training, and FSDP2 stepping the recipes' fused AdamW reaches one process's
weights. Fast: the lockstep loop and the padding rows in one process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.recipes.test_recipes_sft import _reset_accelerate
from tests.support import launch
from tests.support.models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150  # each 2-process run; a deadlock fails here with the ranks' output
# the GRPO launch's modes, in turn: FSDP2 first, before Accelerate sets global state; DDP before the
# DeepSpeed modes, which leave ACCELERATE_USE_DEEPSPEED set in the environment
GRPO_MODES = ("fsdp2", "fsdp2_streaming", "ddp", "ddp_streaming", "zero2", "zero3", "zero3_streaming")
GRPO_TIMEOUT_S = len(GRPO_MODES) * TIMEOUT_S  # the launch's own; the tests' pytest timeout is above it


def _run_two_ranks(args: list[str], what: str, timeout: float = TIMEOUT_S) -> None:
    """``torchrun --nproc_per_node 2 args``; kills the whole process group on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(launch.free_port()),
        *args,
    ]
    launch.run(cmd, what=what, timeout=timeout, env=env, cwd=ROOT)


# ----------------------------------------------------------------------------- GRPO, 2 processes
@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    """One launch runs every engine, sync and streaming, in turn: a launch's start-up is most of its time."""
    out = tmp_path_factory.mktemp("grpo")
    _run_two_ranks(
        ["-m", "tests.support.sharded_worker", ",".join(GRPO_MODES), str(out)],
        f"GRPO under {', '.join(GRPO_MODES)}",
        timeout=GRPO_TIMEOUT_S,
    )
    return {m: [torch.load(out / f"{m}_rank{r}.pt", weights_only=False) for r in range(2)] for m in GRPO_MODES}


@pytest.mark.slow
@pytest.mark.timeout(GRPO_TIMEOUT_S + TIMEOUT_S)  # the fixture's launch, then the test
@pytest.mark.parametrize("mode", ["zero2", "zero3", "fsdp2"])
def test_grpo_sharded_matches_ddp_with_one_optimizer_step_per_grpo_step(grpo_runs, mode):
    ranks, ddp = grpo_runs[mode], grpo_runs["ddp"][0]
    initial = {k: p.detach() for k, p in tiny_model("llama").named_parameters()}
    for r in ranks:
        assert r["optimizer_steps"] == r["grpo_steps"] == 4  # counted by a hook on the torch optimizer
        if mode.startswith("zero"):
            assert r["global_steps"] == 4  # DeepSpeed's own count agrees
        assert all(torch.equal(r["weights"][k], ranks[0]["weights"][k]) for k in initial)  # one model
        # clipping acted: every step's norm is above the 0.5 cap, and the clipped DDP update is matched
        assert all(h["grad_norm"] > 0.5 for h in r["history"])
    moved = max(float((ddp["weights"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3
    for k in initial:
        torch.testing.assert_close(ranks[0]["weights"][k], ddp["weights"][k], atol=1e-6, rtol=1e-5)
    # the two ranks' rollouts really were different lengths, and rank 1 had no prompts at the end
    tokens = [[h["completion_tokens"] for h in r["history"]] for r in ranks]
    assert tokens[0] == [8, 8, 8, 8] and tokens[1][:2] == [96, 96] and tokens[1][2:] == [0, 0]
    assert [h["train_rows"] for h in ranks[1]["history"]][2:] == [0, 0]


@pytest.mark.slow
@pytest.mark.timeout(GRPO_TIMEOUT_S + TIMEOUT_S)  # the fixture's launch, then the test
@pytest.mark.parametrize("mode", ["ddp", "zero3", "fsdp2"])
def test_streaming_steps_together_when_one_ranks_groups_are_much_longer(grpo_runs, mode):
    """Each rank streams its own groups (rank 1's completions 12 times longer); every optimizer step
    is collective (ZeRO-3 / FSDP2: the weights gathered once a step for the rollouts), so both ranks
    end with the same step count and one model, and none hangs; ZeRO-3's and FSDP2's model is DDP's.
    Decoding on the sharded weights, outside the step's gather, is an error on every rank."""
    ranks = grpo_runs[f"{mode}_streaming"]
    initial = {k: p.detach() for k, p in tiny_model("llama").named_parameters()}
    for r in ranks:
        assert r["optimizer_steps"] == r["policy_version"] == 4
        assert all(torch.equal(r["weights"][k], ranks[0]["weights"][k]) for k in initial)
    assert max(float((ranks[0]["weights"][k] - initial[k]).abs().max()) for k in initial) > 1e-3
    tokens = [sum(h["completion_tokens"] for h in r["history"]) for r in ranks]
    assert tokens[1] >= 6 * tokens[0] > 0
    if mode == "ddp":
        return
    for r in ranks:
        assert f"weights sharded ({mode}) over 2 ranks would hang" in r["fence_error"]
    ddp = grpo_runs["ddp_streaming"][0]["weights"]
    # FSDP2 reduce-scatters the gradients and sums the clip norm from the shards' partial norms, so
    # each update rounds differently from DDP's all-reduce: at most one fp32 ulp apart (7.5e-9)
    atol, rtol = (1e-6, 1e-5) if mode == "zero3" else (1e-8, 0.0)
    for k in initial:
        torch.testing.assert_close(ranks[0]["weights"][k], ddp[k], atol=atol, rtol=rtol, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(GRPO_TIMEOUT_S + TIMEOUT_S)  # the fixture's launch, then the test
@pytest.mark.parametrize("mode", ["zero3", "fsdp2"])
def test_sharded_greedy_rollouts_equal_the_unsharded_model(grpo_runs, mode):
    for r in grpo_runs[mode]:
        assert r["greedy"]["gather"] == r["reference"]
        assert r["greedy"]["lockstep"] == r["reference"]
    lengths = [len(ids) for r in grpo_runs[mode] for ids in r["reference"]]
    assert min(lengths) < max(lengths)  # the ranks really stopped at different steps


@pytest.mark.slow
@pytest.mark.timeout(GRPO_TIMEOUT_S + TIMEOUT_S)  # the fixture's launch, then the test
@pytest.mark.parametrize("mode", ["zero3", "fsdp2"])
def test_an_invalid_prompt_on_one_rank_is_an_error_on_every_rank(grpo_runs, mode):
    rank0, rank1 = (r["bad_prompt_errors"] for r in grpo_runs[mode])
    assert len(rank0) == len(rank1) == 2  # gather and lockstep: both raised, the run went on
    assert all("prompt 0: prompt has 2000 tokens" in e for e in rank1)
    assert all("another rank's rollout prompts are invalid" in e for e in rank0)


@pytest.mark.slow
@pytest.mark.timeout(GRPO_TIMEOUT_S + TIMEOUT_S)  # the fixture's launch, then the test
@pytest.mark.parametrize("mode", ["ddp", "zero3", "fsdp2"])
def test_the_plain_generator_on_sharded_weights_refuses_instead_of_hanging(grpo_runs, mode):
    for r in grpo_runs[mode]:
        if mode == "ddp":  # replicated weights: the plain generator is the right tool
            assert r["plain_generate_error"] is None
        else:
            assert f"weights are sharded ({mode}) over 2 ranks" in r["plain_generate_error"]
            assert "sharded_generate(generator, engine, prompts, params)" in r["plain_generate_error"]


# ----------------------------------------------------------------------------- packed SFT, 2 processes
@pytest.mark.slow
@pytest.mark.timeout(450)  # the launch's own 150 s
def test_packed_sft_gradients_under_zero3_and_fsdp2_match_unpacked(tmp_path):
    from tests.training.test_training_loss import _reference_grads, _rows

    _run_two_ranks(["-m", "tests.support.sharded_sft_worker", str(tmp_path)], "packed SFT under ZeRO-3 / FSDP2")
    reference = _reference_grads(_rows(), "token")
    for engine in ("zero3", "fsdp2"):
        ranks = [torch.load(tmp_path / f"{engine}_rank{r}.pt") for r in range(2)]
        assert ranks[0]["steps"] == ranks[1]["steps"] >= 2  # accumulation really used
        assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(len(_rows())))
        for name, ref in reference.items():
            for r in ranks:
                got = r["grads"][name]
                assert torch.linalg.norm(got - ref) <= 1e-5 * torch.linalg.norm(ref), (engine, name)
    _check_fsdp2_adamw_equals_one_process([torch.load(tmp_path / f"fsdp2_rank{r}.pt") for r in range(2)])


def _check_fsdp2_adamw_equals_one_process(ranks: list[dict]) -> None:
    """FSDP2's two steps of the recipes' fused AdamW (``make_adamw``, on the local shards) reach the
    weights of one process stepping the same AdamW on the unsharded model with the same gradients
    (which equal unpacked single-process training's, checked above)."""
    from nopad.training.optimizer import make_adamw
    from tests.support.sharded_sft_worker import ADAMW_LR, ADAMW_WEIGHT_DECAY

    model = tiny_model("llama")
    optimizer = make_adamw(model, ADAMW_LR, ADAMW_WEIGHT_DECAY)
    assert all(g["fused"] for g in optimizer.param_groups) and all(r["fused"] for r in ranks)
    initial = {k: p.detach().clone() for k, p in model.named_parameters()}
    for grads in ranks[0]["step_grads"]:
        for k, p in model.named_parameters():
            p.grad = grads[k]
        optimizer.step()
    assert len(ranks[0]["step_grads"]) == 2
    moved = max(float((p.detach() - initial[k]).abs().max()) for k, p in model.named_parameters())
    assert moved > ADAMW_LR  # two steps of ~lr each: the weights really moved
    for k, p in model.named_parameters():
        for r in ranks:
            torch.testing.assert_close(r["weights"][k], p.detach(), atol=1e-7, rtol=1e-6, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(450)  # the launch's own 150 s
def test_sft_recipe_under_zero3_loss_matches_unpacked(tmp_path):
    from tests.recipes.test_recipes_sft import ONE_STEP_PER_EPOCH, SMALL, _check_two_rank_run

    out = tmp_path / "zero3"
    _run_two_ranks(
        [
            "-m",
            "nopad.recipes.sft",
            *SMALL,
            *ONE_STEP_PER_EPOCH,
            f"checkpoint.output_dir={out}",
            "log.record_indices=true",
            f"accelerate.deepspeed_config={ROOT / 'recipes/configs/deepspeed_zero3.json'}",
        ],
        "SFT recipe under ZeRO-3",
    )
    import json

    _check_two_rank_run([json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)])


# ----------------------------------------------------------------------------- one process
def test_lockstep_generate_alone_equals_generate(one_thread):
    from nopad.inference import Generator, SamplingParams
    from nopad.inference.sharded import generate_lockstep, sharded_generate

    model = tiny_model("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(n=2, max_tokens=6, seed=3)
    gen = Generator(model, num_blocks=32)
    plain = [[c.token_ids for c in o.outputs] for o in gen.generate(prompts, params, use_tqdm=False)]
    lock = [[c.token_ids for c in o.outputs] for o in generate_lockstep(gen, prompts, params)]
    assert lock == plain and generate_lockstep(gen, [], params) == []
    assert sharded_generate(gen, model, [], params) == []
    with pytest.raises(ValueError, match="rollout mode must be one of"):
        sharded_generate(gen, model, prompts, params, mode="fast")


def test_multi_process_without_a_wrapper_is_a_clear_error(monkeypatch):
    from nopad.training.accumulation import OptimizerStepper

    model = tiny_model("llama")
    monkeypatch.setattr("nopad.training.accumulation.world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="DistributedDataParallel or fully_shard"):
        OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_empty_row_adds_no_gradient(one_thread):
    from nopad.packing.hf import use_nopad_attention
    from nopad.training.grpo import empty_rollout_row, packed_logprobs

    model = tiny_model("llama")
    row = empty_rollout_row()
    assert row["num_loss_tokens"] == 0 and row["empty"]
    with use_nopad_attention(model):
        (packed_logprobs(model, row).sum() * 0.0).backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_an_engine_asked_for_but_not_engaged_is_an_error(monkeypatch):
    from types import SimpleNamespace

    from nopad.training.accumulation import check_engine_engaged

    ddp = SimpleNamespace(distributed_type=SimpleNamespace(name="MULTI_CPU"))
    check_engine_engaged(ddp)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RuntimeError, match="FSDP did not engage"):
        check_engine_engaged(ddp)


def test_one_step_over_a_window_and_double_steps_are_errors(one_thread):
    from accelerate import Accelerator

    from nopad.training.accumulation import OptimizerStepper

    _reset_accelerate()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    expected = torch.nn.Linear(4, 2)
    expected.load_state_dict(model.state_dict())
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    rows = [{"num_loss_tokens": n} for n in (2, 3, 5)]
    (sum(expected(x).square().sum() for x in xs) / 10).backward()  # the window's mean over 10 tokens
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    stepper = OptimizerStepper(model, optimizer, accelerator)
    grads = []
    model.weight.register_hook(lambda g: grads.append(g))
    with stepper.window(rows) as w:
        for x in xs:
            with w.row():
                w.backward(model(x).square().sum())
    total = sum(grads)  # the gradient of each row as the optimizer sees it, summed
    torch.testing.assert_close(total, expected.weight.grad, rtol=1e-6, atol=1e-6)
    assert stepper.optimizer_steps == 1 and accelerator.gradient_accumulation_steps == 1
    assert w.grad_norm == pytest.approx(float(expected.weight.grad.norm().hypot(expected.bias.grad.norm())))
    with pytest.raises(RuntimeError, match="3 optimizer steps in one accumulation window of 2 rows"):
        with stepper.window(rows[:2]) as w:
            for x in xs[:2]:
                with w.row():
                    w.backward(model(x).sum())
                optimizer.optimizer.step()  # a stray step inside the window
    with pytest.raises(RuntimeError, match="the window ended after 1 of its 2 rows"):
        with stepper.window(rows[:2]) as w:
            with w.row():
                w.backward(model(xs[0]).sum())
    _reset_accelerate()
