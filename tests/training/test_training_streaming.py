"""Streaming GRPO (:mod:`nopad.training.streaming`): the generator runs on across optimizer steps on
the trainer's own parameters, every sampled token carries the policy version that drew it, and what
a step trains on is decided by the generator's step count alone.

What is proven here: ``max_staleness=0`` is the synchronous step, bitwise; with the weights changing
mid-sequence, every token's recorded behaviour log-prob is the trainer's log-prob under the weights
of its stamped version, bitwise in the batch-invariant mode (``stale_kv=recompute``), or the log-prob
of the mixed computation ``keep`` promises (old KV, new weights); no token older than
``max_staleness`` is trained on, and what is dropped is counted."""

from __future__ import annotations

import copy

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.packing.hf import use_nopad_attention
from nopad.packing.invariance import batch_invariant
from nopad.recipes.config import ConfigError
from nopad.recipes.tiny_model import AsciiTokenizer
from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs
from nopad.training.streaming import StreamingRollouts
from tests.recipes.test_recipes_grpo import tiny_config
from tests.support.models import random_sequences, tiny_model

T = 0.7
LENGTHS = [24, 5, 12, 30, 7, 16, 9, 20]  # completion lengths, long-tailed: groups finish out of order


def run_recipe(policy, dtype, **rollout):
    from nopad.recipes.grpo import run_grpo

    cfg = tiny_config(
        rollout={"prompts_per_step": 2, "num_generations": 4, "max_tokens": 8, **rollout},
        train={"steps": 2, "lr": 1e-3, "batch_invariant": True},
    )
    return run_grpo(cfg, model=policy.to(dtype), tokenizer=AsciiTokenizer(), progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_staleness_0_is_the_synchronous_step_bitwise(dtype, one_thread):
    """Same seeds, exact mode: the streaming recipe at ``max_staleness=0`` trains exactly what the
    synchronous recipe trains, to the last bit of every parameter and metric."""
    base = tiny_model("llama")
    sync, streamed = copy.deepcopy(base), copy.deepcopy(base)
    h_sync = run_recipe(sync, dtype)
    h_stream = run_recipe(streamed, dtype, mode="streaming", max_staleness=0)
    for a, b in zip(h_sync, h_stream, strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "completion_tokens", "logprob_gap_max"):
            assert a[key] == b[key], key
        assert b["staleness_max"] == 0 and b["dropped_groups"] == 0
    assert all(torch.equal(p, q) for p, q in zip(sync.parameters(), streamed.parameters()))


def test_the_decoupled_objective_streams_through_the_policy_loss_seam(one_thread):
    """AReaL's decoupled objective: clipped against the current weights before the step (no extra
    forward), importance-weighted against each token's recorded behaviour log-prob; the step's
    streaming metrics are reported."""
    from nopad.recipes.grpo import STREAMING_CURVES, run_grpo

    cfg = tiny_config(
        rollout={"prompts_per_step": 2, "num_generations": 4, "max_tokens": 8, "mode": "streaming", "max_staleness": 1},
        train={"steps": 2, "lr": 1e-3, "batch_invariant": True, "old_logprobs": "recompute"},
        loss={"is_correction": "token_truncate"},
    )
    decoupled = run_grpo(cfg, model=tiny_model("llama"), tokenizer=AsciiTokenizer(), progress=False)
    assert all(h["forwards_per_optimizer_step"] == h["train_rows"] for h in decoupled)  # no old-log-prob forward
    assert any(k.startswith("mismatch/is/") for k in decoupled[-1])
    assert decoupled[-1]["staleness_max"] <= 1
    assert {"policy_version", "staleness_max", "dropped_groups", *STREAMING_CURVES} <= set(decoupled[-1])


def stream_with_updates(family: str, stale_kv: str, steps: int = 4):
    """Stream groups of long-tailed lengths two per step, perturbing the weights in place after each
    step (an optimizer step's stand-in) and keeping each version's weights. Returns the groups taken,
    the weights by version and the model."""
    model = tiny_model(family)
    gen = Generator(model, block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    prompts = random_sequences([5, 9, 7, 4, 6, 8, 5, 7], seed=1)

    def source(i):
        return prompts[i % 8].tolist(), SamplingParams(
            n=2, max_tokens=LENGTHS[i % 8], temperature=T, seed=i, ignore_eos=True
        )

    stream = StreamingRollouts(
        gen, source, groups_per_step=2, max_staleness=3, stale_kv=stale_kv, total_groups=2 * steps
    )
    weights = {0: copy.deepcopy(model.state_dict())}
    noise = torch.Generator().manual_seed(0)
    taken = []
    for _ in range(steps):
        with batch_invariant(True):
            taken += stream.next_groups()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * 0.05)
        stream.weights_updated(1)
        weights[gen.policy_version] = copy.deepcopy(model.state_dict())
    stream.close()
    mixed = [c for g in taken for c in g.output.outputs if len(set(c.policy_versions)) > 1]
    assert mixed, "no completion spans a weight update: the test would prove nothing"
    return taken, weights, model


def trainer_logprobs(model, weights, prompt, completion) -> torch.Tensor:
    """The trainer's tempered log-prob of each completion token under ``weights`` (a packed row of
    one sequence, in the batch-invariant mode)."""
    scorer = copy.deepcopy(model)
    scorer.load_state_dict(weights)
    rollout = Rollout(list(prompt), list(completion))
    row = pack_rollouts([rollout], len(prompt) + len(completion), shared_prefix=False)[0]
    with torch.no_grad(), batch_invariant(True), use_nopad_attention(scorer):
        return packed_logprobs(scorer, row, T)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_recompute_every_token_is_the_trainers_under_its_stamped_version(family, one_thread):
    """``stale_kv=recompute``: each in-flight sequence re-prefills with the new weights, so every
    recorded behaviour log-prob equals, bitwise, the trainer's log-prob of that token under the
    weights of the version stamped on it, on an attention model and a Gated DeltaNet hybrid."""
    taken, weights, model = stream_with_updates(family, "recompute")
    checked = 0
    for group in taken:
        prompt = group.output.prompt_token_ids
        for c in group.output.outputs:
            recorded = torch.tensor(c.temperature_logprobs)
            for version in sorted(set(c.policy_versions)):
                at = torch.tensor([v == version for v in c.policy_versions])
                want = trainer_logprobs(model, weights[version], prompt, c.token_ids).to(recorded.dtype)
                assert torch.equal(recorded[at], want[at]), (group.index, c.index, version)
                checked += int(at.sum())
    assert checked == sum(len(c.token_ids) for g in taken for c in g.output.outputs)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_keep_continues_on_the_kv_older_weights_wrote(family, one_thread):
    """``stale_kv=keep``: a token sampled after an update reads K/V (and, on a hybrid, recurrent state)
    its sequence's older weights wrote. Its recorded log-prob is that mixed computation's (HF's own
    forward, its cache filled by the weights of each token's version) and not the new weights' alone."""
    taken, weights, model = stream_with_updates(family, "keep")
    reference = copy.deepcopy(model).eval()
    differs = 0
    for group in taken:
        prompt = group.output.prompt_token_ids
        for c in group.output.outputs:
            if len(set(c.policy_versions)) == 1:
                continue
            mixed = []
            cache, inputs = None, torch.tensor([prompt])
            for token, version in zip(c.token_ids, c.policy_versions, strict=True):
                reference.load_state_dict(weights[version])  # this step's weights; the cache is older
                with torch.no_grad():
                    out = reference(inputs, past_key_values=cache, use_cache=True)
                cache, inputs = out.past_key_values, torch.tensor([[token]])
                mixed.append(torch.log_softmax(out.logits[0, -1].float() / T, -1)[token])
            torch.testing.assert_close(torch.tensor(c.temperature_logprobs), torch.stack(mixed), rtol=0, atol=2e-5)
            last = c.policy_versions[-1]
            pure = trainer_logprobs(model, weights[last], prompt, c.token_ids)
            differs += int((pure[-1] - c.temperature_logprobs[-1]).abs() > 1e-4)
    assert differs, "keep gave the new weights' own log-probs: the old KV was not kept"


def test_no_token_older_than_max_staleness_is_trained_and_drops_are_counted(one_thread):
    """A long group overtaken by short ones ages past ``max_staleness``: it is aborted as soon as it
    can no longer be trained on (not decoded to its end) and counted, in groups and tokens; every
    token handed to the trainer is at most ``max_staleness`` steps old."""
    model = tiny_model("llama")
    gen = Generator(model, block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    prompts = random_sequences([5] * 12, seed=2)

    def source(i):  # group 0 runs 60 tokens, the others 3
        return prompts[i].tolist(), SamplingParams(
            n=2, max_tokens=60 if i == 0 else 3, temperature=T, seed=i, ignore_eos=True
        )

    stream = StreamingRollouts(gen, source, groups_per_step=1, max_staleness=1, stale_kv="keep", total_groups=5)
    for _ in range(5):
        groups = stream.next_groups()
        now = gen.policy_version
        assert all(now - v <= 1 for g in groups for c in g.output.outputs for v in c.policy_versions)
        assert 0 not in [g.index for g in groups]
        stream.weights_updated(1)
    stream.close()
    assert stream.stats.dropped_groups == 1 and 0 < stream.stats.dropped_tokens < 2 * 60
    assert max(stream.stats.staleness) <= 1 and stream.stats.trained_groups == 5


def test_the_versions_reach_the_rollout_record():
    """A completion's policy versions travel with its loss tokens (an episode's tool tokens dropped)."""
    from nopad.inference.outputs import CompletionOutput

    c = CompletionOutput(
        0, [5, 6, 7], None, "stop", logprobs=[-1.0] * 3, temperature_logprobs=[-1.0] * 3, policy_versions=[3, 3, 4]
    )
    assert Rollout.from_completion([1, 2], c).policy_versions == [3, 3, 4]
    r = Rollout([1], [5, 6, 7], gen_logprobs=[-1.0, 0.0, -2.0], loss_mask=[1, 0, 1], policy_versions=[2, 2, 3])
    assert r.policy_versions == [2, 3]


@pytest.mark.parametrize(
    ("rollout", "says"),
    [
        ({"mode": "streaming", "max_staleness": -1}, "rollout.max_staleness"),
        ({"mode": "streaming", "stale_kv": "flush"}, "rollout.stale_kv"),
        ({"mode": "stream"}, "rollout.mode"),
    ],
)
def test_bad_streaming_settings_are_one_line_at_the_config(rollout, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        tiny_config(rollout=rollout)


def test_streaming_refuses_what_it_cannot_serve_before_the_model_loads():
    assert tiny_config(rollout={"mode": "streaming"}, task={"name": "calculator"}).rollout.mode == "streaming"
    with pytest.raises(ConfigError, match=r"checkpoint\.every.*streaming tool episodes"):
        tiny_config(rollout={"mode": "streaming"}, task={"name": "calculator"}, checkpoint={"every": 1}, output_dir="x")
    with pytest.raises(ConfigError, match=r"checkpoint\.resume_from.*streaming tool episodes"):
        tiny_config(rollout={"mode": "streaming"}, task={"name": "calculator"}, checkpoint={"resume_from": "latest"})
    with pytest.raises(ConfigError, match="sharded_rollout=gather"):
        tiny_config(rollout={"mode": "streaming"}, generator={"sharded_rollout": "lockstep"})


def test_update_weights_refuses_bad_arguments():
    gen = Generator(tiny_model("llama"), block_size=16, num_blocks=16)
    with pytest.raises(ValueError, match="stale_kv must be one of"):
        gen.update_weights("flush")
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        gen.update_weights("keep", 0)
    gen.update_weights("recompute", 2)
    assert gen.policy_version == 2 and gen.stats()["policy_version"] == 2
