"""TRL's ``GRPOTrainer`` with nopad's training forward: packed rows instead of padded batches.

    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer
    trainer = NopadGRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=prompts,
                               processing_class=tok)    # rollouts: nopad_rollout_func() by default
    trainer.train()

TRL scores every completion (old, reference and current log-probs) with a padded forward of
``[left-padded prompt | right-padded completion]``: each prompt is computed once per completion,
padding is computed too, and on CPU the LM head projects every position. Here the same call
(``_get_per_token_logps_and_entropies``, TRL 1.16) packs the batch into varlen rows:

- ``shared_prefix=True`` (default): the batch is packed as prefix-tree rows
  (:mod:`nopad.packing.bins.tree`): completions with the same prompt form a group whose prompt appears
  once per row and which every completion attends to (and so does any other shared prefix, such
  as the earlier turns of forked episodes). The share of tokens this spares is logged as
  ``tree/token_saving``.
  TRL's sampler deals a prompt's ``num_generations`` copies out consecutively, across processes
  when a process's batch is not a multiple of it, and ``_prepare_inputs`` shuffles the generation
  batch before slicing it into ``steps_per_generation`` micro-batches; so a micro-batch may hold
  part of a group. Groups are found by prompt tokens, not position: whatever completions of a
  prompt the micro-batch holds share one copy of it (one completion: a usual sequence).
- ``shared_prefix=False``: each prompt+completion is its own sequence (usual packing).

Only the positions that predict a completion token reach the LM head; log-probs are
``log_softmax(logits / temperature)`` of the model's own logits (softcapping and scaling
included), as TRL's fused head computes them, scattered back to TRL's ``(B, C)`` layout (0 where
the completion mask is 0). Loss, advantages, clipping and logging stay TRL's.

``batch_invariant=True`` (or ``"auto"``: on where nopad has the mode, i.e. a CPU model) runs this
forward and the nopad rollout under :func:`nopad.packing.batch_invariant`, so the rollout's log-probs
equal the trainer's bitwise: with ``nopad_rollout_func(importance_sampling=True)`` TRL's
importance ratio is exactly 1 on-policy. Off by default: it slows the rollout's small decode
steps (every GEMM on fixed tiles; ``benchmarks/bench_trl.py`` measures the cost).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs, packing_metrics, resolve_batch_invariant
from nopad.training.mismatch import logprob_mismatch
from nopad.training.trl import lazy_class
from nopad.training.trl.compat import check_grpo_trainer, check_loss_type

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the packed forward
def _sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """Per row of TRL's padded batch: (prompt tokens, completion tokens, completion columns)."""
    width = input_ids.size(1) - logits_to_keep
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    out = []
    for b in range(ids.size(0)):
        prompt = ids[b, :width][mask[b, :width]].tolist()
        columns = torch.nonzero(mask[b, width:]).squeeze(1)
        out.append((prompt, ids[b, width:][columns].tolist(), columns.tolist()))
    return out


def packed_completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    *,
    shared_prefix: bool = True,
    compute_entropy: bool = False,
    entropy_grad: bool = True,
    max_tokens_per_forward: int | None = None,
    forward_context=contextlib.nullcontext,
    stats: dict | None = None,
):
    """Log-probs (and entropies) of the completion tokens of TRL's padded batch, from packed rows.

    ``input_ids``/``attention_mask``: ``(B, P + C)``, left-padded prompts then right-padded
    completions; ``logits_to_keep = C``. Returns ``(logps, entropies)`` shaped ``(B, C)`` (entropies
    None unless asked), 0 where the mask is 0, differentiable w.r.t. the model's parameters
    (the entropies only with ``entropy_grad``: TRL needs their gradient for its entropy bonus alone).
    The rows are packed and scored by :mod:`nopad.training.grpo`, the code the GRPO recipe runs.
    ``model`` must run nopad attention (``model.set_attn_implementation("nopad")``).
    ``forward_context`` is entered around every forward (autocast, batch-invariant mode).
    ``stats``, when given, receives :func:`nopad.training.grpo.packing_metrics` of the rows.
    """
    device = input_ids.device
    batch, width = input_ids.size(0), logits_to_keep
    seqs = _sequences(input_ids, attention_mask, logits_to_keep)
    order = [b for b in range(batch) if seqs[b][1]]  # rows with no completion token score nothing
    empty_rows = [b for b in order if not seqs[b][0]]
    if empty_rows:
        raise ValueError(f"batch rows {empty_rows} have no prompt token: nothing predicts their first completion token")
    logps = torch.zeros(batch, width, device=device)
    entropies = torch.zeros(batch, width, device=device) if compute_entropy else None
    if not order:
        # keep the result connected to the model, as TRL's masked scatter does
        zero = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
        return logps + zero, entropies
    rollouts = [Rollout(seqs[b][0], seqs[b][1]) for b in order]  # TRL's forward scores them
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    capacity = max(max_tokens_per_forward or sum(lengths), max(lengths))  # a sequence is never split
    scatter_rows, scatter_cols, picked, entropy_parts = [], [], [], []
    rows = pack_rollouts(rollouts, capacity, shared_prefix=shared_prefix)
    if stats is not None:
        stats.update(packing_metrics(rows, rollouts))
    for row in rows:
        row = row.to(device)
        with forward_context():
            scored = packed_logprobs(
                model, row, temperature, compute_entropy=compute_entropy, entropy_grad=entropy_grad
            )
        row_logps, row_entropies = scored if compute_entropy else (scored, None)
        picked.append(row_logps)
        if compute_entropy:
            entropy_parts.append(row_entropies)
        for i in row.indices.tolist():  # the row's completions, in pair order
            b = order[i]
            scatter_rows += [b] * len(seqs[b][1])
            scatter_cols += seqs[b][2]
    index = (torch.tensor(scatter_rows, device=device), torch.tensor(scatter_cols, device=device))
    logps = logps.index_put(index, torch.cat(picked))
    if compute_entropy:
        entropies = entropies.index_put(index, torch.cat(entropy_parts))
    return logps, entropies


# ----------------------------------------------------------------------------- the trainer
class NopadGRPOTrainerMixin:
    """Put in front of ``GRPOTrainer`` (or a subclass): ``class T(NopadGRPOTrainerMixin, GRPOTrainer)``.

    ``shared_prefix``: every shared prefix (a prompt, forked turns) computed once per packed row
    (default; prefix-tree rows) or usual packing.
    ``batch_invariant``: False (default) / True / ``"auto"`` (on where exact: a CPU model), for
    this forward and the default rollout. On costs speed: small decode steps run 32-row GEMM
    tiles (``benchmarks/bench_trl.py`` measures it).
    ``max_tokens_per_forward``: tokens of one packed forward (default: the whole micro-batch, one
    forward per call on every rank, as ZeRO-3 / FSDP2 need: leave it unset there).
    ``rollout_func`` defaults to :func:`nopad.training.trl.rollout.nopad_rollout_func` with the same
    ``batch_invariant``; ``nopad_rollout=False`` keeps TRL's own generation instead.
    """

    def __init__(
        self,
        *args: Any,
        shared_prefix: bool = True,
        batch_invariant: bool | str = False,
        max_tokens_per_forward: int | None = None,
        nopad_rollout: bool = True,
        **kwargs: Any,
    ):
        if shared_prefix not in (True, False):
            raise ValueError(f"shared_prefix must be True or False, got {shared_prefix!r}")
        if max_tokens_per_forward is not None and max_tokens_per_forward < 2:
            raise ValueError(f"max_tokens_per_forward must be >= 2, got {max_tokens_per_forward}")
        check_grpo_trainer(type(self))  # every private TRL name this mixin and the rollout touch
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, str):
            raise ValueError(
                "NopadGRPOTrainer needs the model object (the rollout and the attention switch "
                "use it); load it first, e.g. AutoModelForCausalLM.from_pretrained(...)"
            )
        self.nopad_shared_prefix = shared_prefix
        self.nopad_max_tokens_per_forward = max_tokens_per_forward
        train_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        check_loss_type(train_args)
        device = getattr(train_args, "device", None) or next(model.parameters()).device  # where it will train
        self.nopad_batch_invariant = resolve_batch_invariant(batch_invariant, device)
        if nopad_rollout and kwargs.get("rollout_func") is None:
            from nopad.training.trl.rollout import nopad_rollout_func

            kwargs["rollout_func"] = nopad_rollout_func(batch_invariant=self.nopad_batch_invariant)
        rollout = kwargs.get("rollout_func")
        if getattr(rollout, "batch_invariant", self.nopad_batch_invariant) != self.nopad_batch_invariant:
            logger.warning(
                "the nopad rollout_func has batch_invariant=%s but the trainer %s: rollout and "
                "trainer log-probs will not be bitwise equal",
                rollout.batch_invariant,
                self.nopad_batch_invariant,
            )
        self.nopad_generates = kwargs.get("rollout_func") is not None
        super().__init__(*args, **kwargs)
        from nopad.packing.hf import register_nopad_attention
        from nopad.packing.mixers import TREE, check_model

        register_nopad_attention()
        policy = self.accelerator.unwrap_model(self.model)
        check_model(policy, TREE)  # its rows are prefix-tree rows (a group's prompt laid once)
        self._refuse_uneven_sharded_forwards(policy)
        from nopad.training.trl.rollout import NopadRollout, sampling_params

        if isinstance(rollout, NopadRollout):  # bad generation settings fail now, not at the first rollout
            sampling_params(self)
        self._nopad_previous_attention = policy.config._attn_implementation
        # for good, not per call: gradient checkpointing recomputes the forward during the backward
        for model in (policy, getattr(self, "ref_model", None)):
            if model is not None:
                self.accelerator.unwrap_model(model).set_attn_implementation("nopad")

    def _refuse_uneven_sharded_forwards(self, policy) -> None:
        """Split forwards hang under ZeRO-3 / FSDP2: each rank would run as many forwards as its own
        micro-batch needs, and every forward all-gathers the weights from all ranks."""
        if self.nopad_max_tokens_per_forward is None or self.accelerator.num_processes < 2:
            return
        from nopad.inference.sharded import sharded_weights

        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        zero3 = plugin is not None and getattr(plugin, "zero_stage", None) == 3
        if zero3 or getattr(self, "is_fsdp_enabled", False) or sharded_weights(policy) is not None:
            raise ValueError(
                "max_tokens_per_forward splits a micro-batch into a number of forwards that differs between "
                "ranks, which deadlocks under ZeRO-3 / FSDP (every forward all-gathers the weights from all "
                "ranks); leave max_tokens_per_forward=None (one packed forward per micro-batch) or lower "
                "per_device_train_batch_size instead"
            )

    def _generate(self, prompts):
        """TRL's own in-process generation runs padded batches: give it its attention back."""
        if self.nopad_generates or self.use_vllm:
            return super()._generate(prompts)
        policy = self.accelerator.unwrap_model(self.model)
        policy.set_attn_implementation(self._nopad_previous_attention)
        try:
            return super()._generate(prompts)
        finally:
            policy.set_attn_implementation("nopad")

    def training_step(self, *args: Any, **kwargs: Any):
        """The whole step in the batch-invariant mode when on: the rollout, the log-prob forwards and
        the backward, whose gradient-checkpointing recompute must replay the forward's kernels."""
        from nopad.packing.invariance import batch_invariant

        with batch_invariant(self.nopad_batch_invariant):
            return super().training_step(*args, **kwargs)

    def _forward_context(self):
        from nopad.packing.invariance import batch_invariant

        stack = contextlib.ExitStack()
        stack.enter_context(self.accelerator.autocast())  # as TRL's own forward
        stack.enter_context(batch_invariant(self.nopad_batch_invariant))
        return stack

    def _compute_loss(self, model, inputs):
        """TRL's loss; its policy forward also reports how far the rollout's log-probs are
        (:func:`nopad.training.mismatch.logprob_mismatch` over the model tokens, logged as ``mismatch/*``)."""
        rollout = inputs.get("sampling_per_token_logps")
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:  # TRL's loss mask: an episode's tool tokens are not the model's
            mask = mask * inputs["tool_mask"]
        self._nopad_rollout_logps = None if rollout is None else (rollout, mask)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._nopad_rollout_logps = None

    def _report_mismatch(self, logps: torch.Tensor) -> None:
        pending = getattr(self, "_nopad_rollout_logps", None)
        if pending is None or pending[0].shape != logps.shape:
            return
        self._nopad_rollout_logps = None  # once per loss forward
        mode = "train" if self.model.training else "eval"
        for key, value in logprob_mismatch(logps, *pending).items():
            self._metrics[mode][key].append(value)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's per-token log-probs and entropies, from packed rows (see module docstring)."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:
            what = given or "an MoE aux loss"
            raise ValueError(
                f"NopadGRPOTrainer packs text-only batches; this one has {what}. Use "
                "GRPOTrainer for multimodal / MoE-aux-loss training"
            )
        stats = {}
        logps, entropies = packed_completion_logprobs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            float(self.temperature),
            shared_prefix=self.nopad_shared_prefix,
            compute_entropy=compute_entropy,
            entropy_grad=bool(getattr(self, "_entropy_bonus_enabled", True)),
            max_tokens_per_forward=self.nopad_max_tokens_per_forward,
            forward_context=self._forward_context,
            stats=stats,
        )
        if stats and hasattr(self, "_metrics"):
            self._metrics["train" if self.model.training else "eval"]["tree/token_saving"].append(
                stats["tree_token_saving"]
            )
        self._report_mismatch(logps)
        return logps, entropies, None


def _grpo_trainer_class() -> type:
    from trl import GRPOTrainer

    class NopadGRPOTrainer(NopadGRPOTrainerMixin, GRPOTrainer):
        """TRL ``GRPOTrainer`` with nopad rollouts and packed (shared-prefix) training forwards."""

    return NopadGRPOTrainer


__getattr__ = lazy_class(globals(), "NopadGRPOTrainer", _grpo_trainer_class)
