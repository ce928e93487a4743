"""nopad inside the trainers people use: TRL's GRPOTrainer (rollout_func), SFTTrainer and
transformers' Trainer, run for real on tiny random models (fp32, CPU, a few steps)."""

from __future__ import annotations

import contextlib
import copy
import functools
import os

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Trainer, TrainerCallback, TrainingArguments

from nopad.dataloaders.sampler import PackedBatchSampler
from nopad.training.trainer import NopadTrainer, TrainerEpochSampler
from tests.support.models import tiny_model

trl = pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary, with a chat template."""
    words = ["<pad>", "<bos>", "<eos>", "<unk>", "user", "assistant"] + [f"w{i}" for i in range(122)]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _texts(n: int, seed: int, low: int = 3, high: int = 40) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g)
    return [" ".join(f"w{int(t)}" for t in torch.randint(6, 120, (int(k),), generator=g)) for k in lengths]


# ----------------------------------------------------------------------------- GRPO
def _grpo(tok, tmp_path, rollout, prompts=None, cls=None, batch_invariant=None, **config):
    from trl import GRPOConfig, GRPOTrainer

    prompts = prompts if prompts is not None else _texts(8, seed=3, low=2, high=7)
    settings = dict(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        learning_rate=1e-2,
        seed=0,
    )
    settings.update(config)
    model = tiny_model("llama")
    model.train()
    extra = {}
    if cls is None:
        cls = GRPOTrainer
    if batch_invariant is not None:
        extra["batch_invariant"] = batch_invariant
    trainer = cls(
        **extra,
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=GRPOConfig(**settings),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        rollout_func=rollout,
    )
    return trainer


def test_grpo_trains_and_the_log_probs_make_the_importance_ratio(tok, tmp_path, one_thread):
    from nopad.training.trl.rollout import nopad_rollout_func

    rollout = nopad_rollout_func(importance_sampling=True, max_num_batched_tokens=128)
    trainer = _grpo(tok, tmp_path, rollout)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # it trained
    batch = trainer._buffered_inputs[0]
    mask = batch["completion_mask"].bool()
    # TRL recomputed the log-probs with its own padded forward and built the ratio from ours
    gap = (batch["sampling_per_token_logps"] - batch["old_per_token_logps"]).abs()[mask]
    assert gap.max() < 1e-4
    assert torch.allclose(batch["importance_sampling_ratio"], torch.ones(()), atol=1e-3)
    logged = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    assert len(logged) == 2
    assert all(abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for h in logged)
    # one generator for the run, its KV cache handed back before the backward
    assert rollout.generator is not None and rollout.generator._kv_cache is None


def test_rollout_matches_trl_contract_and_settings(tok, tmp_path, one_thread):
    """Default path (no IS flag): one completion per prompt entry, groups prefilled once, the
    trainer's sampling settings honoured, and the log-probs are TRL's sampling_per_token_logps."""
    from nopad.inference.sampling_filters import processed_logprobs
    from nopad.training.trl.rollout import nopad_rollout_func, sampling_params

    rollout = nopad_rollout_func(max_num_batched_tokens=128)
    trainer = _grpo(
        tok,
        tmp_path,
        rollout,
        max_steps=1,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.01,
        repetition_penalty=1.1,
        max_completion_length=5,
    )
    params = sampling_params(trainer)
    assert (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        params.max_tokens,
    ) == (0.7, 0.9, 20, 0.01, 1.1, 5)
    assert params.stop_token_ids == [tok.eos_token_id]
    prompts = ["w10 w11 w12"] * 4 + ["w20 w21"] * 4
    out = rollout(prompts, trainer)
    assert len(out["completion_ids"]) == len(out["logprobs"]) == len(out["prompt_ids"]) == 8
    assert out["prompt_ids"][0] == tok("w10 w11 w12")["input_ids"] and out["prompt_ids"][4] == [26, 27]
    assert rollout.last_stats["prefill_tokens"] == 3 + 2  # each group's prompt prefilled once
    for completion, logprobs in zip(out["completion_ids"], out["logprobs"]):
        assert 1 <= len(completion) <= 5 and len(completion) == len(logprobs)
    # with temperature and filters on, the log-probs are those of softmax(logits / T) that TRL's
    # trainer scores (its own padded forward), not those of the top-p/top-k-truncated distribution
    trl_logps, logits = _trl_scores(trainer, out["prompt_ids"], out["completion_ids"])
    ours = np.concatenate(out["logprobs"])
    assert np.allclose(ours, trl_logps, atol=1e-5)
    truncated = torch.cat(
        [
            processed_logprobs(lg, [params] * len(lg))[torch.arange(len(c)), torch.tensor(c)]
            for lg, c in zip(logits, out["completion_ids"])
        ]
    )
    assert float((truncated - torch.tensor(ours)).abs().max()) > 1e-2
    # conversational prompts go through the chat template
    chat = rollout([[{"role": "user", "content": "w30 w31"}]] * 2, trainer)
    assert chat["prompt_ids"][0] == tok("user w30 w31 assistant")["input_ids"]
    trainer.train()
    assert "sampling_per_token_logps" in trainer._buffered_inputs[0]


def _trl_scores(trainer, prompt_ids, completion_ids):
    """TRL's own per-token log-probs of the completions (its padded forward, its temperature), and
    each completion's raw logits (eager forward, one sequence at a time)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import pad

    def padded(rows, side):
        ids = pad([torch.tensor(r) for r in rows], padding_value=0, padding_side=side)
        mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], padding_value=0, padding_side=side)
        return ids, mask

    (p, pm), (c, cm) = padded(prompt_ids, "left"), padded(completion_ids, "right")
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([p, c], 1), torch.cat([pm, cm], 1), c.size(1)
        )
        logits = [
            trainer.model(input_ids=torch.tensor([list(pi) + list(ci)])).logits[0, len(pi) - 1 : -1]
            for pi, ci in zip(prompt_ids, completion_ids)
        ]
    return logps[cm.bool()].numpy(), logits


def test_rollout_refuses_what_it_cannot_honour(tok, tmp_path, monkeypatch):
    import nopad.packing.invariance
    from nopad.training.trl.rollout import nopad_rollout_func, sampling_params

    trainer = _grpo(tok, tmp_path, nopad_rollout_func(), generation_kwargs={"typical_p": 0.5})
    with pytest.raises(ValueError, match="typical_p"):
        sampling_params(trainer)
    with pytest.raises(ValueError, match="tool_timeout"):
        nopad_rollout_func(tool_timeout=0)
    entered = []
    real = nopad.packing.invariance.batch_invariant

    @contextlib.contextmanager
    def recording_batch_invariant(enabled=True, kernels=None):
        entered.append(enabled)
        with real(enabled, kernels):
            yield

    monkeypatch.setattr("nopad.training.trl.rollout.batch_invariant", recording_batch_invariant)
    rollout = nopad_rollout_func(batch_invariant=True)
    trainer = _grpo(tok, tmp_path, rollout)
    rollout(["w10 w11"] * 4, trainer)
    assert entered == [True]


# ----------------------------------------------------------------------------- SFT / Trainer
@pytest.mark.parametrize("loss_type", ["nll", "chunked_nll"])  # TRL's fused head; chunked_nll its old name
def test_sft_trainer_loss_and_gradients_equal_unpacked(tok, tmp_path, loss_type, one_thread):
    from trl import SFTConfig

    from nopad.training.trl.sft_trainer import NopadSFTTrainer

    grads, seen = [], []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    class Recording(NopadSFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            indices = inputs["indices"].tolist()
            loss = super().training_step(model, inputs, num_items_in_batch)
            seen.append((indices, float(loss)))
            return loss

    model = tiny_model("llama")
    model.train()
    reference = copy.deepcopy(model)
    args = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_length=64,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        max_grad_norm=0.0,
        loss_type=loss_type,
    )
    data = datasets.Dataset.from_dict({"text": _texts(24, 0)})
    trainer = Recording(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[Grab()])
    assert model.config._attn_implementation == "nopad" and trainer.nopad_tokens() == 128
    trainer.train()
    assert len(seen) == 2 and all(len(indices) > 1 for indices, _ in seen)  # two packed micro-batches
    # the same sequences, one at a time with eager attention, loss = mean over all their loss tokens
    rows = trainer.train_dataset
    ids = [i for indices, _ in seen for i in indices]
    total = sum(int((torch.tensor(rows[i]["labels"])[1:] != -100).sum()) for i in ids)
    reference.set_attn_implementation("eager")
    loss = 0.0
    for i in ids:
        logits = reference(input_ids=torch.tensor([rows[i]["input_ids"]])).logits[0, :-1]
        loss = loss + torch.nn.functional.cross_entropy(
            logits, torch.tensor(rows[i]["labels"][1:]), ignore_index=-100, reduction="sum"
        )
    loss = loss / total
    loss.backward()
    assert sum(mb_loss for _, mb_loss in seen) == pytest.approx(loss.item(), abs=1e-5)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[0][name], p.grad, atol=1e-6, rtol=1e-5)


def test_sft_trainer_refuses_trl_packing(tok, tmp_path):
    from trl import SFTConfig

    from nopad.training.trl.sft_trainer import NopadSFTTrainer

    with pytest.raises(ValueError, match="packing=False"):
        NopadSFTTrainer(
            model=tiny_model("llama"),
            processing_class=tok,
            args=SFTConfig(output_dir=str(tmp_path), packing=True, report_to=[], use_cpu=True),
            train_dataset=datasets.Dataset.from_dict({"text": _texts(4, 0)}),
        )


class _Recording(NopadTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(inputs["indices"].tolist())
        return super().training_step(model, inputs, num_items_in_batch)


def _resume_run(ds, out, resume=None, tokens_per_batch=96):
    model = tiny_model("llama")
    model.train()
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=7,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        learning_rate=1e-3,
        seed=0,
    )
    trainer = _Recording(model=model, args=args, train_dataset=ds, tokens_per_batch=tokens_per_batch)
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_trainer_loss_runs_the_chunked_head_and_equals_the_models_own(tmp_path, one_thread):
    g = torch.Generator().manual_seed(2)
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [
                torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (8,), generator=g)
            ]
        }
    )
    model = tiny_model("gemma2")  # a softcapped head
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, report_to=[], use_cpu=True)
    trainer = NopadTrainer(model=model, args=args, train_dataset=ds, tokens_per_batch=96)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    results = []
    for compute_loss in (trainer.compute_loss, functools.partial(Trainer.compute_loss, trainer)):
        model.zero_grad()
        loss = compute_loss(model, dict(inputs), num_items_in_batch=torch.tensor(37))
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ours, grads), (theirs, want) = results
    assert ours == pytest.approx(theirs, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6 * float(want[name].abs().max()))


def test_trainer_resume_continues_with_the_same_batches(tmp_path, one_thread):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 40, (30,), generator=g)
    ds = datasets.Dataset.from_dict(
        {"input_ids": [torch.randint(4, 120, (int(n),), generator=g).tolist() for n in lengths]}
    )
    out = str(tmp_path / "run")
    full = _resume_run(ds, out)
    per_epoch = len(full.nopad_loader)
    assert per_epoch % 2 == 0 and len(full.seen) == 14 > per_epoch  # 7 steps x 2 micro-batches, > 1 epoch
    # checkpoint-2 is mid-epoch 0; checkpoint-4 is in epoch 1: both continue exactly
    for step in (2, 4):
        checkpoint = os.path.join(out, f"checkpoint-{step}")
        assert os.path.isfile(os.path.join(checkpoint, "nopad_loader.json"))
        resumed = _resume_run(ds, str(tmp_path / f"resumed{step}"), resume=checkpoint)
        assert resumed.seen == full.seen[2 * step :]
    with pytest.raises(ValueError, match="tokens_per_batch"):
        _resume_run(ds, str(tmp_path / "other"), resume=os.path.join(out, "checkpoint-2"), tokens_per_batch=80)


def test_trainer_epochs_are_a_gapless_stream_of_packed_epochs():
    lengths = np.random.default_rng(0).integers(1, 60, size=200)
    packed = PackedBatchSampler(lengths, 128, num_replicas=1, rank=0, seed=0)
    stream = []
    for epoch in range(4):
        packed.set_epoch(epoch)
        stream.extend(list(packed))
    sampler = TrainerEpochSampler(PackedBatchSampler(lengths, 128, num_replicas=1, rank=0, seed=0))
    steps = len(sampler)
    trainer_epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == steps
        trainer_epochs.extend(batches)
    assert trainer_epochs == stream[: 3 * steps]


def test_bf16_autocast_and_bf16_weights(tok, tmp_path, one_thread):
    """What users train in: GRPO under bf16 autocast (fp32 weights), SFT on bf16 weights."""
    from trl import SFTConfig

    from nopad.training.trl.rollout import nopad_rollout_func
    from nopad.training.trl.sft_trainer import NopadSFTTrainer

    trainer = _grpo(tok, tmp_path, nopad_rollout_func(importance_sampling=True), bf16=True, max_steps=1)
    trainer.train()
    ratio = trainer.state.log_history[0]["sampling/importance_sampling_ratio/mean"]
    assert abs(ratio - 1) < 0.05  # bf16 numerics: close to, not exactly, 1
    model = tiny_model("llama").to(torch.bfloat16)
    model.train()
    args = SFTConfig(
        output_dir=str(tmp_path / "sft16"),
        max_length=64,
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
    )
    sft = NopadSFTTrainer(
        model=model, args=args, processing_class=tok, train_dataset=datasets.Dataset.from_dict({"text": _texts(12, 1)})
    )
    sft.train()
    assert np.isfinite(sft.state.log_history[-1]["train_loss"])


# ----------------------------------------------------------------------------- GRPO trainer side
def _fixed_rollout(prompts, trainer):
    """Deterministic completions of varied lengths (1..7 tokens, some ending in EOS): the same
    rollouts for every trainer compared."""
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    completions = []
    for i, ids in enumerate(prompt_ids):
        n = 1 + (sum(ids) + 3 * i) % 7
        completion = [6 + (7 * sum(ids) + 11 * i + 5 * j) % 100 for j in range(n)]
        if i % 3 == 0:
            completion[-1] = tokenizer.eos_token_id
        completions.append(completion)
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": [[-1.0] * len(c) for c in completions]}


class _GradRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})


def _grpo_step_grads(tok, tmp_path, cls, loss_config=None, **kwargs):
    from trl import GRPOConfig

    model = tiny_model("llama")
    model.train()
    recorder = _GradRecorder()
    # steps_per_generation=2: TRL shuffles the generation batch across two micro-batches, so each
    # holds parts of groups; temperature 0.7 and the entropy bonus reach the loss too
    args = GRPOConfig(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=8,
        num_generations=4,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_completion_length=7,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        temperature=0.7,
        entropy_coef=0.01,
        learning_rate=1e-3,
        logging_steps=1,
        **(loss_config or {}),
    )
    prompts = datasets.Dataset.from_dict({"prompt": _texts(4, seed=5, low=2, high=9)})
    reward = lambda completion_ids, **kw: [float(len(c)) for c in completion_ids]  # noqa: E731
    trainer = cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=prompts,
        processing_class=tok,
        rollout_func=_fixed_rollout,
        callbacks=[recorder],
        **kwargs,
    )
    trainer.train()
    return trainer, recorder.grads[0]


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_nopad_grpo_trainer_logprobs_loss_and_gradients_equal_trls_padded_path(
    tok, tmp_path, shared_prefix, one_thread
):
    from trl import GRPOTrainer

    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer

    reference, ref_grads = _grpo_step_grads(tok, tmp_path, GRPOTrainer)
    nopad, grads = _grpo_step_grads(tok, tmp_path, NopadGRPOTrainer, shared_prefix=shared_prefix)
    assert nopad.model.config._attn_implementation == "nopad"
    assert sum(float(g.abs().sum()) for g in ref_grads.values()) > 0
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5)
    loss = [h["loss"] for h in nopad.state.log_history if "loss" in h]
    ref_loss = [h["loss"] for h in reference.state.log_history if "loss" in h]
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    saving = [h["tree/token_saving"] for h in nopad.state.log_history if "tree/token_saving" in h]
    assert saving and (saving[0] > 0) == shared_prefix  # each prompt once per row, logged
    # log-probs and entropies of one (shuffled, partial-group) micro-batch, straight
    batch = nopad._buffered_inputs[0]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    prompts = [tuple(p[m.bool()].tolist()) for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    assert len(set(prompts)) < len(prompts)  # some completions share a prompt in this micro-batch
    with torch.no_grad():
        ours = nopad._get_per_token_logps_and_entropies(nopad.model, ids, mask, keep, compute_entropy=True)
        nopad.model.set_attn_implementation(reference.model.config._attn_implementation)
        theirs = GRPOTrainer._get_per_token_logps_and_entropies(
            nopad, nopad.model, ids, mask, keep, compute_entropy=True
        )
    completion_mask = batch["completion_mask"].bool()
    torch.testing.assert_close(ours[0], theirs[0] * completion_mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], theirs[1] * completion_mask, atol=1e-5, rtol=0)
    assert bool((ours[0][completion_mask] < 0).all())


@pytest.mark.parametrize(
    "loss_config",
    [
        {"loss_type": "grpo"},
        {"loss_type": "dr_grpo"},
        {"loss_type": "bnpo"},
        {"loss_type": "cispo", "epsilon_high": 5.0},
        {"loss_type": "sapo"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
        {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True},
    ],
    ids=["grpo", "dr_grpo", "bnpo", "cispo", "sapo", "gspo", "dapo_clip_higher_masked"],
)
def test_nopad_grpo_trainer_equals_trls_padded_path_for_each_loss_type(tok, tmp_path, loss_config, one_thread):
    """TRL's loss code runs unchanged on nopad's tree-row log-probs: each loss_type gives the
    padded path's loss and gradients (the recipe's own losses:
    tests/training/test_training_policy_loss.py)."""
    from trl import GRPOTrainer

    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer

    reference, ref_grads = _grpo_step_grads(tok, tmp_path, GRPOTrainer, loss_config)
    nopad, grads = _grpo_step_grads(tok, tmp_path, NopadGRPOTrainer, loss_config)
    assert sum(float(g.abs().sum()) for g in ref_grads.values()) > 0
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5)
    loss = [h["loss"] for h in nopad.state.log_history if "loss" in h]
    assert loss == pytest.approx([h["loss"] for h in reference.state.log_history if "loss" in h], abs=1e-5)


def logp_recorder(seen: list, base=None):
    """A ``NopadGRPOTrainer`` (or ``base``) subclass that appends ``(inputs, the loss forward's
    log-probs)`` of each loss computation to ``seen``: what the bitwise tests hold against the
    rollout's log-probs."""
    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer

    class Recording(base or NopadGRPOTrainer):
        def _compute_loss(self, model, inputs):
            inner = self._get_per_token_logps_and_entropies

            def grab(*args, **kwargs):
                out = inner(*args, **kwargs)
                seen.append((inputs, out[0].detach().clone()))
                return out

            self._get_per_token_logps_and_entropies = grab
            try:
                return super()._compute_loss(model, inputs)
            finally:
                del self._get_per_token_logps_and_entropies

    return Recording


@pytest.mark.parametrize("bf16", [False, True])
def test_batch_invariant_rollout_and_trainer_log_probs_are_bitwise_equal(tok, tmp_path, bf16, one_thread):
    """On-policy, the importance ratio is exactly 1: the rollout's log-probs (temperature-scaled, with
    top-p on), TRL's old log-probs and the loss forward's are the same bits, fp32 and bf16 autocast.
    (Without the batch-invariant mode both dtypes fail these equalities.)"""
    from nopad.training.trl.rollout import nopad_rollout_func

    seen = []

    Recording = logp_recorder(seen)

    rollout = nopad_rollout_func(importance_sampling=True, batch_invariant=True, max_num_batched_tokens=64)
    trainer = _grpo(
        tok,
        tmp_path,
        rollout,
        cls=Recording,
        batch_invariant=True,
        max_steps=1,
        bf16=bf16,
        temperature=0.7,
        top_p=0.9,
        max_completion_length=8,
    )
    trainer.train()
    assert len(seen) == 1
    inputs, current = seen[0]
    mask = inputs["completion_mask"].bool()
    sampled, old = inputs["sampling_per_token_logps"][mask], inputs["old_per_token_logps"][mask]
    assert torch.equal(sampled, old) and torch.equal(current[mask], old)
    assert bool((inputs["importance_sampling_ratio"] == 1).all())  # TRL's IS weight (per sequence)
    assert bool((sampled < 0).all()) and mask.sum() > 8


@pytest.fixture(scope="module")
def fsdp2_rollouts(tmp_path_factory):
    """One 2-process launch runs both rollout modes (a launch's start-up is most of its time)."""
    from tests.training.test_training_sharded import TIMEOUT_S, _run_two_ranks

    out = tmp_path_factory.mktemp("trl_fsdp2")
    _run_two_ranks(
        ["-m", "tests.support.trl_fsdp2_worker", "gather,lockstep", str(out)],
        "TRL rollout under FSDP2",
        timeout=2 * TIMEOUT_S,
    )  # the two launches' budget
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)  # the fixture's two launches, 300 s
@pytest.mark.parametrize("mode", ["gather", "lockstep"])
def test_rollout_on_an_fsdp2_sharded_policy(fsdp2_rollouts, mode):
    """2 CPU processes, FSDP2 over gloo, ranks generating 1 vs 12 tokens: no deadlock, and the
    tokens' log-probs are those of the full (unsharded) weights."""
    for rank in (0, 1):
        result = torch.load(fsdp2_rollouts / f"trl_{mode}_rank{rank}.pt", weights_only=False)
        out = result["out"]
        assert len(out["completion_ids"]) == 8
        longest = max(len(c) for c in out["completion_ids"])
        assert longest == 1 if rank == 0 else longest > 1  # rank 1 keeps stepping alone
        np.testing.assert_allclose(np.concatenate(out["logprobs"]), np.concatenate(result["expected"]), atol=1e-5)


@pytest.mark.parametrize("shared_prefix, budget", [(True, None), (True, 16), (False, 16)])
def test_packed_completion_logprobs_equal_one_sequence_at_a_time(shared_prefix, budget, one_thread):
    """TRL's padded layout in, (B, C) log-probs and entropies out, for whole groups, groups split
    over rows (a 16-token budget splits the 20-token group), a row whose completion is masked out entirely."""
    from nopad.packing.hf import register_nopad_attention
    from nopad.training.trl.grpo_trainer import packed_completion_logprobs

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 4)]
    completions = [torch.randint(3, 128, (1 + (5 * i) % 7,), generator=g).tolist() for i in range(6)]
    rows = [(prompts[i // 3], c) for i, c in enumerate(completions)]
    width_p, width_c = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(rows):
        ids[b, width_p - len(p) : width_p], mask[b, width_p - len(p) : width_p] = torch.tensor(p), 1
        ids[b, width_p : width_p + len(c)], mask[b, width_p : width_p + len(c)] = torch.tensor(c), 1
    mask[4, width_p:] = 0  # TRL's mask_truncated_completions: nothing of row 4 is scored
    model = tiny_model("llama")
    register_nopad_attention()
    reference = copy.deepcopy(model)
    model.set_attn_implementation("nopad")
    stats = {}
    logps, entropies = packed_completion_logprobs(
        model,
        ids,
        mask,
        width_c,
        0.7,
        shared_prefix=shared_prefix,
        compute_entropy=True,
        max_tokens_per_forward=budget,
        stats=stats,
    )
    flat = sum(len(p) + len(c) for b, (p, c) in enumerate(rows) if b != 4)
    assert stats["flat_train_tokens"] == flat
    assert (stats["tree_token_saving"] > 0) == shared_prefix  # the prompts, once per row
    for b, (p, c) in enumerate(rows):
        n = 0 if b == 4 else len(c)
        logits = reference(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float() / 0.7
        lp = torch.log_softmax(logits, -1)
        expect = torch.zeros(width_c)
        expect[:n] = lp[torch.arange(n), torch.tensor(c[:n], dtype=torch.long)]
        torch.testing.assert_close(logps[b].detach(), expect, atol=1e-5, rtol=0)
        expect_h = torch.zeros(width_c)
        expect_h[:n] = -(lp.exp() * lp).sum(-1)[:n]
        torch.testing.assert_close(entropies[b].detach(), expect_h, atol=1e-5, rtol=0)
    logps.sum().backward()  # differentiable
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_batch_invariant_setting_follows_where_the_model_trains(monkeypatch, caplog):
    from nopad.training.trl.grpo_trainer import resolve_batch_invariant

    assert resolve_batch_invariant("auto", "cpu") is True
    assert resolve_batch_invariant(False, "cpu") is False
    with caplog.at_level("WARNING"):  # the Triton kernel set exists, but auto waits for a GPU measurement
        assert resolve_batch_invariant("auto", "cuda") is False
    assert "until the Triton kernel set's cost is measured on a GPU" in caplog.text
    assert resolve_batch_invariant(True, "cuda") is True
    from nopad.packing import invariant_kernels

    monkeypatch.setattr(invariant_kernels, "available", lambda: (False, "triton is not installed"))
    with caplog.at_level("WARNING"):
        assert resolve_batch_invariant("auto", "cuda") is False
    assert "Triton kernels and triton is not installed" in caplog.text
    with pytest.raises(ValueError, match="batch_invariant=True is not available"):
        resolve_batch_invariant(True, "cuda")
    monkeypatch.undo()
    monkeypatch.setenv("NOPAD_ATTN_BACKEND", "sdpa")
    assert resolve_batch_invariant("auto", "cpu") is False
    with pytest.raises(ValueError, match="'auto', True or False"):
        resolve_batch_invariant("yes", "cpu")


def test_split_forwards_are_refused_under_zero3_and_fsdp():
    from types import SimpleNamespace

    from nopad.training.trl.grpo_trainer import NopadGRPOTrainerMixin

    policy = torch.nn.Linear(2, 2)
    refuse = NopadGRPOTrainerMixin._refuse_uneven_sharded_forwards

    def accelerator(stage):
        plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(num_processes=2, state=SimpleNamespace(deepspeed_plugin=plugin))

    zero3 = accelerator(3)
    trainer = SimpleNamespace(nopad_max_tokens_per_forward=512, accelerator=zero3)
    with pytest.raises(ValueError, match="deadlocks under ZeRO-3 / FSDP.*leave max_tokens_per_forward=None"):
        refuse(trainer, policy)
    fsdp = SimpleNamespace(nopad_max_tokens_per_forward=512, accelerator=accelerator(None), is_fsdp_enabled=True)
    with pytest.raises(ValueError, match="deadlocks"):
        refuse(fsdp, policy)
    refuse(SimpleNamespace(nopad_max_tokens_per_forward=None, accelerator=zero3), policy)  # one forward: fine
    zero2 = SimpleNamespace(nopad_max_tokens_per_forward=512, accelerator=accelerator(2))
    refuse(zero2, policy)  # replicated weights: split forwards are fine


@pytest.mark.parametrize(
    "config,message",
    [
        ({"temperature": 0.0}, "temperature=0"),
        ({"generation_kwargs": {"typical_p": 0.5}}, "typical_p"),
        (
            {"loss_type": "ppo"},
            r"^GRPOConfig.loss_type='ppo' is not a loss TRL's GRPOTrainer knows; use one "
            r"of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo$",
        ),
    ],
)
def test_grpo_trainer_rejects_bad_generation_settings_at_construction(tok, tmp_path, config, message):
    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer

    with pytest.raises(ValueError, match=message):
        _grpo(tok, tmp_path, None, cls=NopadGRPOTrainer, **config)


def test_sft_trainer_with_an_empty_dataset_says_so(tok, tmp_path):
    from trl import SFTConfig

    from nopad.training.trl.sft_trainer import NopadSFTTrainer

    with pytest.raises(ValueError, match="train_dataset is empty"):
        NopadSFTTrainer(
            model=tiny_model("llama"),
            processing_class=tok,
            args=SFTConfig(output_dir=str(tmp_path), packing=False, report_to=[], use_cpu=True),
            train_dataset=datasets.Dataset.from_dict({"text": []}),
        )
