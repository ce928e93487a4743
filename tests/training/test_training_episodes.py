"""Multi-turn tool episodes as training data: NopadGRPOTrainer with TRL's ``tools`` and
``environment_factory`` on a tiny random model, the loss on the model's tokens only, exact
log-probs, tool faults counted, and the GRPO recipe's tool task.

The random model is steered to write tool calls: a forward hook raises the logit of the one-token
call ``CALL_TEXT`` after a newline (so every assistant turn may open with a call) and of
``<|im_end|>`` after a call, in the generator's forwards and the trainer's alike.
"""

from __future__ import annotations

import os

import datasets
import pytest
import torch

from tests.inference.test_inference_episodes import CALL_TEXT, char_tokenizer
from tests.support.models import tiny_model

trl = pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def steer(model, tok, call_bias: float = 6.0):
    """Bias the logits after "\\n" towards the call token and after a call towards <|im_end|>,
    for every batch row (padded batches too)."""
    newline, call = tok.convert_tokens_to_ids("\n"), tok.convert_tokens_to_ids(CALL_TEXT)
    eos = tok.eos_token_id

    def hook(module, args, kwargs, out):
        ids = kwargs["input_ids"]
        keep = kwargs.get("logits_to_keep", 0)
        bias = torch.zeros_like(out.logits)
        for b in range(ids.size(0)):
            rows = ids[b][keep] if isinstance(keep, torch.Tensor) else (ids[b, -keep:] if keep else ids[b])
            rows = rows[-out.logits.size(1) :]
            bias[b, :, call] = (rows == newline).to(bias.dtype) * call_bias
            bias[b, :, eos] = (rows == call).to(bias.dtype) * 1000.0
        out.logits = out.logits + bias  # not in place: the logits may be a custom Function's output
        return out

    return model.register_forward_hook(hook, with_kwargs=True)


def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


def failing_add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    raise RuntimeError("the adder is broken")


failing_add.__name__ = "add"  # the name the scripted call uses


class Adder:
    """An environment: ``add`` is its tool; it counts its calls, which the reward reads."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return str(a + b)


PROMPTS = [[{"role": "user", "content": f"what is {i} + {i + 1}?"}] for i in range(4)]


def length_reward(completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


def make_trainer(
    tok,
    tmp_path,
    *,
    tools=None,
    environment_factory=None,
    reward=length_reward,
    batch_invariant=False,
    importance_sampling=False,
    cls=None,
    **config,
):
    from trl import GRPOConfig

    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer
    from nopad.training.trl.rollout import nopad_rollout_func

    settings = dict(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=48,
        max_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        learning_rate=1e-2,
        seed=0,
        max_tool_calling_iterations=2,
    )
    settings.update(config)
    model = tiny_model("llama", max_position_embeddings=4096)
    model.train()
    rollout = nopad_rollout_func(
        importance_sampling=importance_sampling,
        batch_invariant=batch_invariant,
        max_num_batched_tokens=512,
        block_size=16,
        num_blocks=256,
    )
    trainer = (cls or NopadGRPOTrainer)(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**settings),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tok,
        rollout_func=rollout,
        tools=tools,
        environment_factory=environment_factory,
        batch_invariant=batch_invariant,
    )
    return trainer, rollout


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_trainer_with_tools_trains_on_the_model_tokens_of_episodes(tok, tmp_path):
    trainer, rollout = make_trainer(tok, tmp_path, tools=[add], max_steps=2)
    handle = steer(trainer.model, tok)
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    finally:
        handle.remove()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # it trained
    episodes = rollout.last_episodes
    assert sum(ep.num_tool_calls for ep in episodes) > 0
    assert all(ep.num_turns <= 3 for ep in episodes)  # max_tool_calling_iterations=2: three model turns
    batch = trainer._buffered_inputs[0]
    # TRL's tool mask is the episodes' model mask: tool tokens carry no loss
    assert "tool_mask" in batch and bool((batch["tool_mask"][batch["completion_mask"].bool()] == 0).any())
    for ep in episodes:
        for turn in ep.turns:
            if turn.tool_end > turn.end:
                assert [c.result for c in turn.tool_calls] == ["5"] * len(turn.tool_calls)
    frequency = logged(trainer, "tools/call_frequency")
    assert len(frequency) == 2 and all(v > 0 for v in frequency)
    assert logged(trainer, "tools/failure_frequency") == [0.0, 0.0]
    for key in ("mismatch/outside_band", "mismatch/ratio_dev_p95", "mismatch/ratio_dev_max"):
        assert len(logged(trainer, key)) == 2
    assert rollout.generator._kv_cache is None  # the KV cache went back before the backward


def test_trainer_with_environment_factory_gives_each_completion_its_environment(tok, tmp_path):
    seen = []

    def env_reward(completion_ids, environments, **kwargs):
        seen.append([e.calls for e in environments])
        return [float(e.calls) + 0.01 * len(c) for e, c in zip(environments, completion_ids)]

    trainer, rollout = make_trainer(tok, tmp_path, environment_factory=Adder, reward=env_reward)
    handle = steer(trainer.model, tok)
    try:
        trainer.train()
    finally:
        handle.remove()
    episodes = rollout.last_episodes
    # each completion called its own environment: its calls are its episode's tool calls
    assert seen[-1] == [ep.num_tool_calls for ep in episodes]
    assert sum(seen[-1]) > 0
    assert len({id(e) for e in trainer.environments}) == len(episodes)


def test_a_tool_that_raises_is_counted_and_the_step_goes_on(tok, tmp_path):
    trainer, rollout = make_trainer(tok, tmp_path, tools=[failing_add])
    handle = steer(trainer.model, tok, call_bias=1000.0)  # every turn calls
    try:
        trainer.train()
    finally:
        handle.remove()
    calls = [c for ep in rollout.last_episodes for t in ep.turns for c in t.tool_calls if c.result is not None]
    assert calls and all(c.error and "the adder is broken" in c.result for c in calls)
    assert logged(trainer, "tools/failure_frequency") == [1.0]


def test_log_probs_on_tool_episodes_equal_trls_padded_path(tok, tmp_path):
    from trl import GRPOTrainer

    trainer, _ = make_trainer(tok, tmp_path, tools=[add], steps_per_generation=1)
    handle = steer(trainer.model, tok)
    try:
        trainer.train()
    finally:
        handle.remove()
    batch = trainer._buffered_inputs[0]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    model_tokens = (batch["completion_mask"] * batch["tool_mask"]).bool()
    assert bool((batch["tool_mask"][batch["completion_mask"].bool()] == 0).any())
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)[0]
        trainer.model.set_attn_implementation("sdpa")
        theirs = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, keep)[0]
    torch.testing.assert_close(ours[model_tokens], theirs[model_tokens], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_batch_invariant_importance_ratio_is_exactly_one_on_tool_episodes(tok, tmp_path, bf16):
    from tests.training.test_training_trl import logp_recorder

    seen = []

    Recording = logp_recorder(seen)

    trainer, rollout = make_trainer(
        tok,
        tmp_path,
        tools=[add],
        batch_invariant=True,
        importance_sampling=True,
        cls=Recording,
        bf16=bf16,
        temperature=0.7,
        top_p=0.9,
    )
    handle = steer(trainer.model, tok)
    try:
        trainer.train()
    finally:
        handle.remove()
    inputs, current = seen[0]
    mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    assert sum(ep.num_tool_calls for ep in rollout.last_episodes) > 0  # multi-turn episodes
    sampled, old = inputs["sampling_per_token_logps"][mask], inputs["old_per_token_logps"][mask]
    assert torch.equal(sampled, old) and torch.equal(current[mask], old)
    assert bool((inputs["importance_sampling_ratio"] == 1).all())
    assert logged(trainer, "mismatch/ratio_dev_max") == [0.0]


# ----------------------------------------------------------------------------- the mismatch report
def test_mismatch_report_counts_model_tokens_outside_the_band():
    from nopad.training.mismatch import logprob_mismatch

    rollout = torch.zeros(2, 3)
    train = torch.log(torch.tensor([[1.0, 1.05, 1.5], [0.5, 1.0, 9.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 9.0 is a tool token
    report = logprob_mismatch(train, rollout, mask)
    assert report["mismatch/outside_band"] == pytest.approx(2 / 5)
    assert report["mismatch/ratio_dev_max"] == pytest.approx(0.5)
    assert 0.05 < report["mismatch/ratio_dev_p95"] <= 0.5
    assert logprob_mismatch(train, train) == dict.fromkeys(report, 0.0)


# ----------------------------------------------------------------------------- loss mask in packing
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_tool_tokens_carry_no_loss_in_packed_rollouts(shared_prefix):
    from nopad.packing.row import IGNORE_INDEX
    from nopad.training.grpo import Rollout, pack_rollouts, pair_advantages

    rollouts = [
        Rollout([1, 2], [10, 11, 12, 13], [-1.0, -9.0, -9.0, -2.0], advantage=0.5, loss_mask=[1, 0, 0, 1]),
        Rollout([1, 2], [20, 21], [-3.0, -4.0], advantage=-0.5),
    ]
    (row,) = pack_rollouts(rollouts, 64, shared_prefix=shared_prefix)
    labels = row.labels[0].tolist()
    assert [t for t in labels if t != IGNORE_INDEX] == [10, 13, 20, 21]
    assert row.token_values["gen_logprobs"].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert pair_advantages(row, rollouts).tolist() == [0.5, 0.5, -0.5, -0.5] and row.num_loss_tokens == 4
    with pytest.raises(ValueError, match="loss_mask"):
        pack_rollouts([Rollout([1], [5, 6], [-1.0, -1.0], loss_mask=[1])], 64, shared_prefix=shared_prefix)


def test_a_rollout_is_built_once_from_the_generators_output():
    """The one RL record: an episode's log-probs (0.0 at tool tokens) kept for the model's tokens
    only, once, at construction; a plain sample's as they are; the advantage one number."""
    from types import SimpleNamespace

    from nopad.training.grpo import Rollout, pack_rollouts

    episode = SimpleNamespace(
        prompt_token_ids=[1, 2],
        completion_ids=[10, 11, 12, 13],
        logprobs=[-1.0, 0.0, 0.0, -2.0],
        model_mask=[1, 0, 0, 1],
        finish_reason="length",
    )
    r = Rollout.from_episode(episode, "raw")  # which log-probs: test_training_grpo_temperature.py
    assert (r.prompt_ids, r.completion_ids, r.loss_mask) == ([1, 2], [10, 11, 12, 13], [1, 0, 0, 1])
    assert (r.gen_logprobs, r.num_loss_tokens, r.truncated) == ([-1.0, -2.0], 2, True)
    sample = SimpleNamespace(token_ids=[20, 21], logprobs=[-3.0, -4.0], finish_reason="stop")
    plain = Rollout.from_completion([1, 2], sample, "raw")
    assert (plain.gen_logprobs, plain.loss_mask, plain.num_loss_tokens, plain.truncated) == ([-3.0, -4.0], (), 2, False)
    (row,) = pack_rollouts([r, plain], 64)
    assert row.token_values["gen_logprobs"].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert "advantages" not in row.token_values  # one per rollout, expanded by the loss
    with pytest.raises(ValueError, match=r"1 gen_logprobs for 2 sampled tokens \(3 completion tokens\)"):
        pack_rollouts([Rollout([1], [5, 6, 7], [-1.0], loss_mask=[1, 0, 1])], 64)


# ----------------------------------------------------------------------------- the recipe's tool task
def test_calculator_tool_and_text_format():
    from nopad.recipes.tasks import last_number_match
    from nopad.recipes.tiny_model import AsciiTokenizer
    from nopad.recipes.tool_tasks import TextToolFormat, calculator, calculator_task

    assert calculator("17 * 23 + 4") == "395" and calculator("-(2 - 5)") == "3"
    for bad in ("__import__('os')", "2 ** 99", "1 / 0", "x"):
        with pytest.raises(ValueError):
            calculator(bad)
    ex = calculator_task(num_prompts=3, seed=1)
    assert len(ex) == 3 and all(last_number_match(e["answer"], e) == 1.0 for e in ex)
    tok = AsciiTokenizer()
    fmt = TextToolFormat(tok)
    (call,) = fmt.parse(tok.encode("let me see <calc>2 * 3</calc>"), [])
    assert (call.name, call.arguments) == ("calculator", {"expression": "2 * 3"})
    assert fmt.parse(tok.encode("it is 6"), []) == []
    with pytest.raises(ValueError):
        fmt.parse(tok.encode("oops</calc>"), [])
    assert tok.decode(fmt.render([{"content": "6"}], [])) == "<result>6</result>\n"


def test_recipe_tool_task_runs_a_step_on_episodes(monkeypatch):
    """The calculator task through run_grpo; the random model's turns end at frequent stop
    strings and every other turn is read as a calculator call, so episodes have tool turns."""
    from nopad.recipes import tasks, tool_tasks
    from nopad.recipes.config import from_dict
    from nopad.recipes.grpo import run_grpo
    from nopad.recipes.grpo_config import GRPORecipeConfig
    from nopad.recipes.models import load_model

    class EveryOtherTurnCalls(tool_tasks.TextToolFormat):
        def parse(self, turn_ids, prefix_ids):
            return [] if len(turn_ids) % 2 else [tool_tasks.ToolCall("calculator", {"expression": "6 * 7"})]

    task = tasks.Task(
        tool_tasks.calculator_task,
        {"calculator": tool_tasks.calculator},
        stop=tuple(chr(c) for c in range(48, 80)),
        tool_format=EveryOtherTurnCalls,
    )
    monkeypatch.setitem(tasks.TASKS, "calculator", task)
    cfg = from_dict(
        GRPORecipeConfig,
        {
            "model": {"path": "tiny:llama"},
            "task": {"name": "calculator", "num_prompts": 4},
            "rollout": {
                "prompts_per_step": 2,
                "num_generations": 4,
                "max_tokens": 48,
                "max_prompt_tokens": 200,
                "max_turns": 4,
            },
            "train": {"steps": 1, "max_tokens_per_batch": 2048, "lr": 1e-3},
        },
    )
    model, tokenizer = load_model(cfg.model)
    from nopad.training import grpo_step as step_module

    trained = []
    inner = step_module.train_on_rollouts

    def recording(stepper, rollouts, *args, **kwargs):
        trained.extend(rollouts)
        return inner(stepper, rollouts, *args, **kwargs)

    monkeypatch.setattr(step_module, "train_on_rollouts", recording)
    (metrics,) = run_grpo(cfg, model=model, tokenizer=tokenizer, progress=False)
    assert metrics["tool_calls_per_episode"] > 0 and metrics["tool_failure_rate"] == 0.0
    # trained on the model's tokens only: the tool results are context
    assert any(0 in r.loss_mask for r in trained)
    assert metrics["completion_tokens"] == sum(sum(r.loss_mask) for r in trained)
    assert metrics["logprob_gap_max"] == 0.0 and metrics["mismatch/ratio_dev_max"] == 0.0  # CPU: invariant
