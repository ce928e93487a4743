"""The policy-loss seam: every loss and IS mode against a written-out formula on hand-made
tensors, and against TRL 1.16's own ``GRPOTrainer._compute_loss`` on the same inputs; bad knobs."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from nopad.training.policy_loss import IS_MODES, LOSSES, PolicyBatch, PolicyLossConfig, make_policy_loss, objective
from nopad.training.policy_loss.importance import importance_weights

LENGTHS = [4, 2, 3]  # three completions, right-padded to 4 in TRL's layout
ADV = [1.0, -0.5, 0.3]
KNOBS = {
    "grpo": {},
    "dr_grpo": {"max_completion_length": 6},
    "dapo": {"epsilon_high": 0.28},
    "bnpo": {},
    "gspo": {"epsilon": 3e-4, "epsilon_high": 4e-4},
    "cispo": {"epsilon_high": 5.0},
    "sapo": {},
}


def padded_inputs(seed: int = 0, truncated: int | None = None):
    """TRL's (B, T) tensors: new / old / ref / rollout log-probs, entropies and the mask."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in LENGTHS])
    if truncated is not None:  # TRL's mask_truncated_completions zeroes the completion's mask
        mask[truncated] = 0.0
    logp = (-torch.rand(b, t, generator=g) * 2).requires_grad_()
    old = (logp.detach() + 0.3 * torch.randn(b, t, generator=g)).clamp(max=0)
    return {
        "logp": logp,
        "old": old,
        "ref": old - 0.1 * torch.rand(b, t, generator=g),
        "rollout": old + 0.4 * torch.randn(b, t, generator=g),
        "entropy": torch.rand(b, t, generator=g) * 3,
        "mask": mask,
        "adv": torch.tensor(ADV),
    }


def pairs(p: dict) -> PolicyBatch:
    """The same values as nopad's per-pair tensors: one pair per completion token, ``seq`` its row."""
    at = torch.tensor([[s, k] for s, n in enumerate(LENGTHS) for k in range(n)])
    s, k = at[:, 0], at[:, 1]
    return PolicyBatch(
        p["logp"][s, k],
        p["old"][s, k],
        p["adv"][s],
        s,
        len(LENGTHS),
        mask=p["mask"][s, k],
        ref_logp=p["ref"][s, k],
        rollout_logp=p["rollout"][s, k],
        entropy=p["entropy"][s, k],
    )


def nopad_loss(cfg: PolicyLossConfig, p: dict) -> torch.Tensor:
    """The loss as the recipe's step computes it: the row's sum over the step's count."""
    loss = make_policy_loss(cfg)
    out = loss(pairs(p))
    tokens = float(p["mask"].sum())
    count = tokens if loss.normalizer == "tokens" else float(len(LENGTHS))
    return objective(out, cfg, count, tokens) / count


# ----------------------------------------------------------------------------- written-out formulas
def reference(loss_type: str, p: dict, knobs: dict, beta=0.0, entropy_coef=0.0, is_weight=None):
    """Each paper's formula, as TRL implements it, written out on the padded tensors."""
    logp, old, adv, m = p["logp"], p["old"], p["adv"][:, None], p["mask"]
    eps_l = knobs.get("epsilon", 0.2)
    eps_h = knobs.get("epsilon_high", eps_l)
    log_r = logp - old
    if loss_type == "gspo":  # one ratio per sequence: exp of the mean log-ratio over its tokens
        log_r = ((log_r * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    r = torch.exp(log_r)
    if loss_type == "cispo":
        per_token = -torch.clamp(r, max=eps_h).detach() * adv * logp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, 1.0, 1.05)
        per_token = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
    else:
        per_token = -torch.minimum(r * adv, torch.clamp(r, 1 - eps_l, 1 + eps_h) * adv)
    if is_weight is not None:
        per_token = per_token * is_weight
    if beta:
        kl = torch.exp(p["ref"] - logp) - (p["ref"] - logp) - 1
        per_token = per_token + beta * kl * r
    if loss_type in ("grpo", "gspo", "sapo"):
        loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (logp.shape[0] * knobs["max_completion_length"])
    else:
        loss = (per_token * m).sum() / m.sum()
    return loss - entropy_coef * (p["entropy"] * m).sum() / m.sum()


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_each_loss_equals_its_written_out_formula(loss_type):
    p = padded_inputs()
    knobs = KNOBS[loss_type]
    got = nopad_loss(PolicyLossConfig(loss_type=loss_type, **knobs), p)
    want = reference(loss_type, p, knobs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    (g_got,) = torch.autograd.grad(got, p["logp"])
    (g_want,) = torch.autograd.grad(want, p["logp"])
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_kl_entropy_and_a_masked_truncated_completion(loss_type):
    p = padded_inputs(seed=3, truncated=1)
    knobs = KNOBS[loss_type]
    cfg = PolicyLossConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01, **knobs)
    got = nopad_loss(cfg, p)
    torch.testing.assert_close(got, reference(loss_type, p, knobs, beta=0.04, entropy_coef=0.01), rtol=1e-6, atol=1e-7)


def test_clipping_by_hand():
    """PPO's clip on three tokens, ratios 1.5 / 0.5 / 1.1 against advantages 1 / -1 / 1."""
    b = PolicyBatch(
        torch.log(torch.tensor([1.5, 0.5, 1.1])),
        torch.zeros(3),
        torch.tensor([1.0, -1.0, 1.0]),
        torch.tensor([0, 1, 2]),
        3,
    )
    out = make_policy_loss(PolicyLossConfig(loss_type="dapo"))(b)
    torch.testing.assert_close(out.loss, torch.tensor(-1.2 + 0.8 - 1.1))
    assert out.metrics["clip_ratio/high_mean"] == 1 and out.metrics["clip_ratio/low_mean"] == 1
    delta = make_policy_loss(PolicyLossConfig(loss_type="dapo", delta=1.05, epsilon_high=0.6))(b)
    torch.testing.assert_close(delta.loss, torch.tensor(-1.05 + 0.8 - 1.05))  # the unclipped ratio capped


# ----------------------------------------------------------------------------- IS correction
def reference_is(mode: str, p: dict, lo, hi) -> torch.Tensor:
    """TRL's importance_sampling_ratio (``_generate_and_score_completions``), written out."""
    diff = torch.nan_to_num((p["old"] - p["rollout"]) * p["mask"], nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(r, min=lo, max=hi)
    lo, hi = -math.inf if lo is None else lo, math.inf if hi is None else hi
    return r.masked_fill((r < lo) | (r > hi), 0.0)


@pytest.mark.parametrize("mode", IS_MODES)
def test_each_is_mode_equals_trls_formula(mode):
    p = padded_inputs(seed=1)
    lo, hi = 0.8, 1.25
    cfg = PolicyLossConfig(loss_type="dapo", is_correction=mode, is_clip_min=lo, is_clip_max=hi)
    weight = reference_is(mode, p, lo, hi)
    torch.testing.assert_close(nopad_loss(cfg, p), reference("dapo", p, {}, is_weight=weight))
    b = pairs(p)
    w, touched = importance_weights(b.old_logp, b.rollout_logp, b.mask, b.seq, 3, mode, lo, hi)
    torch.testing.assert_close(w, weight.expand_as(p["mask"])[b.seq, _cols()])
    raw = reference_is(mode.replace("truncate", "mask"), p, None, None)  # no bounds: the raw ratio
    raw = raw.expand_as(p["mask"])[b.seq, _cols()]
    outside = (raw < lo) | (raw > hi)
    assert touched["is/tokens_touched"] == float(outside.sum()) > 0
    assert touched["is/seqs_touched"] == float(len(set(b.seq[outside].tolist())))


def _cols() -> torch.Tensor:
    return torch.tensor([k for n in LENGTHS for k in range(n)])


def test_is_weights_are_exactly_one_when_the_rollout_is_the_trainer():
    b = pairs(padded_inputs())
    for mode in IS_MODES:
        w, touched = importance_weights(b.old_logp, b.old_logp, b.mask, b.seq, 3, mode, 0.5, 2.0)
        assert bool((w == 1).all()) and touched == {"is/tokens_touched": 0.0, "is/seqs_touched": 0.0}


# ----------------------------------------------------------------------------- TRL's own loss code
def trl_loss(loss_type: str, p: dict, knobs: dict, *, beta=0.0, entropy_coef=0.0, is_ratio=None):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` run on ``p`` (one process, no accumulation): the
    trainer's attributes it reads, and a forward that returns ``p["logp"]``."""
    from trl import GRPOTrainer

    level = "sequence" if loss_type == "gspo" else "token"
    b, t = p["mask"].shape
    args = SimpleNamespace(
        delta=knobs.get("delta"),
        use_bias_correction_kl=True,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        steps_per_generation=1,
    )
    acc = SimpleNamespace(
        num_processes=1,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        sync_gradients=True,
    )
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (p["logp"], p["entropy"], None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=args,
        loss_type="grpo" if loss_type == "gspo" else loss_type,
        epsilon_low=knobs.get("epsilon", 0.2),
        epsilon_high=knobs.get("epsilon_high", knobs.get("epsilon", 0.2)),
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=acc,
        _metrics=defaultdict(lambda: defaultdict(list)),
        max_completion_length=knobs.get("max_completion_length", t),
        _entropy_bonus_enabled=bool(entropy_coef),
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
    )
    inputs = {
        "prompt_ids": torch.ones(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": p["mask"].long(),
        "advantages": p["adv"],
        "old_per_token_logps": p["old"],
        "ref_per_token_logps": p["ref"],
        "num_items_in_batch": p["mask"].sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_each_loss_equals_trls_compute_loss(loss_type):
    pytest.importorskip("trl")
    p = padded_inputs(seed=2, truncated=2)
    knobs = KNOBS[loss_type]
    want, trl_metrics = trl_loss(loss_type, p, knobs, beta=0.04, entropy_coef=0.01)
    cfg = PolicyLossConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01, **knobs)
    got = nopad_loss(cfg, p)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    (g_got,) = torch.autograd.grad(got, p["logp"])
    (g_want,) = torch.autograd.grad(want, p["logp"])
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-7)
    if loss_type in ("grpo", "dapo", "bnpo", "dr_grpo"):  # TRL's clip metrics: token means
        out = make_policy_loss(cfg)(pairs(p))
        tokens = float(p["mask"].sum())
        assert out.metrics["clip_ratio/region_mean"] / tokens == pytest.approx(trl_metrics["clip_ratio/region_mean"][0])


@pytest.mark.parametrize("mode", IS_MODES)
def test_each_is_mode_equals_trls_compute_loss(mode):
    pytest.importorskip("trl")
    p = padded_inputs(seed=4)
    ratio = reference_is(mode, p, 0.7, 1.3)
    want, _ = trl_loss("dapo", p, {}, is_ratio=ratio)
    cfg = PolicyLossConfig(loss_type="dapo", is_correction=mode, is_clip_min=0.7, is_clip_max=1.3)
    torch.testing.assert_close(nopad_loss(cfg, p), want, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"loss_type": "ppo"}, r"^loss_type 'ppo' is unknown; use one of \['bnpo', 'cispo'"),
        ({"epsilon_high": 0.1}, r"^epsilon_high \(0.1\) is below epsilon \(0.2\)"),
        ({"loss_type": "sapo", "epsilon_high": 0.28}, r"^epsilon_high has no effect with loss_type=sapo"),
        (
            {"loss_type": "cispo", "epsilon": 0.1, "epsilon_high": 5.0},
            r"^epsilon has no effect with loss_type=cispo",
        ),
        (
            {"loss_type": "gspo", "importance_sampling_level": "sequence"},
            r"^importance_sampling_level has no effect with loss_type=gspo",
        ),
        (
            {"loss_type": "dapo", "sapo_temperature_neg": 2.0},
            r"^sapo_temperature_neg has no effect .* loss_type sapo",
        ),
        ({"loss_type": "cispo"}, r"^epsilon_high must be set for loss_type=cispo"),
        ({"loss_type": "dr_grpo"}, r"^max_completion_length must be set for loss_type=dr_grpo"),
        ({"is_correction": "tis"}, r"^is_correction 'tis' is unknown; use none or one of"),
        (
            {"is_correction": "token_mask", "is_clip_min": 2.0, "is_clip_max": 1.0},
            r"^is_clip_min \(2.0\) must be below",
        ),
        # each of these used to train silently on a loss that could not learn or divided by 0
        ({"delta": 0.5}, r"^delta must be > 1 .* got 0.5"),
        ({"loss_type": "sapo", "sapo_temperature_neg": -1.0}, r"^sapo_temperature_neg must be > 0"),
        ({"loss_type": "sapo", "sapo_temperature_pos": 0.0}, r"^sapo_temperature_pos must be > 0"),
        ({"is_correction": "token_truncate", "is_clip_max": -1.0}, r"^is_clip_max must be > 0 or null"),
        ({"is_clip_min": 0.5}, r"^is_clip_min has no effect with is_correction=none"),
        ({"is_clip_max": 5.0}, r"^is_clip_max has no effect with is_correction=none"),
    ],
)
def test_bad_knobs_are_one_clear_line(knobs, message):
    with pytest.raises(ValueError, match=message) as err:
        PolicyLossConfig(**knobs)
    assert "\n" not in str(err.value)


def test_the_recipe_names_the_section_of_a_bad_knob():
    from nopad.recipes.config import load_config
    from nopad.recipes.grpo_config import GRPORecipeConfig

    with pytest.raises(ValueError, match=r"^loss.epsilon_high \(0.1\) is below epsilon"):
        load_config(GRPORecipeConfig, overrides=["loss.epsilon_high=0.1"])
    with pytest.raises(ValueError, match=r"^loss.delta has no effect with loss_type=sapo"):
        load_config(GRPORecipeConfig, overrides=["loss.loss_type=sapo", "loss.delta=2.0"])
    with pytest.raises(ValueError, match=r"^loss.is_correction token_mask weighs .* train.old_logprobs=recompute"):
        load_config(GRPORecipeConfig, overrides=["loss.is_correction=token_mask"])
    cfg = load_config(GRPORecipeConfig, overrides=["loss.loss_type=dr_grpo", "rollout.max_tokens=16"])
    assert cfg.loss.policy(cfg.rollout.max_tokens).max_completion_length == 16
