"""The optimizer steps of one GRPO step (:func:`nopad.training.grpo_step.train_on_rollouts`): the
rollouts cut into mini-batches (:class:`MiniBatch`: packed rows, counting masks, advantages, cached
old / reference log-probs), one optimizer step over each (:func:`train_window`), and the metrics they
add up (:class:`StepMetrics`). ``loss`` is the step's
:class:`~nopad.training.grpo_step.GRPOStepConfig` (not imported: grpo_step imports this module)."""

from __future__ import annotations

import torch

from nopad.packing.distributed import global_sum, world_size
from nopad.packing.invariance import batch_invariant
from nopad.training.accumulation import pad_rows
from nopad.training.grpo import (
    Rollout,
    empty_rollout_row,
    pack_rollouts,
    packed_logprobs,
    pair_advantages,
    pair_sequences,
)
from nopad.training.policy_loss import PolicyBatch, objective


class MiniBatch:
    """One mini-batch of the rollout batch: its padded rows, each pair's counting mask and
    advantage, and the cached per-row old / reference log-probs (computed once, reused by every
    pass), all at ``temperature``: the trained policy's (:func:`nopad.training.grpo.policy_temperature`)."""

    def __init__(self, rollouts: list[Rollout], chunk: list[int], loss, temperature: float):
        self.temperature = temperature
        rows = pack_rollouts([rollouts[i] for i in chunk], loss.max_tokens_per_batch, shared_prefix=loss.shared_prefix)
        # every rank the same number of rows (under ZeRO-3 / FSDP2 each forward is a collective), and
        # a row even where this rank has no rollouts: the window steps once on every rank
        self.rows = pad_rows(rows, empty_rollout_row) or [empty_rollout_row()]
        self.seqs = [pair_sequences(row) for row in self.rows]
        mine = [rollouts[i] for i in chunk]
        self.advantages = [pair_advantages(row, mine) for row in self.rows]
        self.masks = []
        for row, seq in zip(self.rows, self.seqs):
            keep = torch.ones(seq.numel())
            if row.empty:
                keep.zero_()
            elif loss.mask_truncated_completions:  # TRL: a truncated completion carries no loss
                cut = torch.tensor([rollouts[chunk[i]].truncated for i in row.indices.tolist()])
                keep = (~cut[seq.cpu()]).float()
            self.masks.append(keep)
        self.old: list[torch.Tensor] | None = None
        self.ref: dict[int, torch.Tensor] = {}

    def counts(self, policy) -> list[float]:
        """Per row, what the loss is normalised by: counted tokens, or sequences with a pair."""
        if policy.normalizer == "tokens":
            return [float(m.sum()) for m in self.masks]
        return [0.0 if row.empty else float(torch.unique(s).numel()) for row, s in zip(self.rows, self.seqs)]


class StepMetrics:
    """What the optimizer steps of one GRPO step add up: losses, gradient norms, metric sums, ratios."""

    def __init__(self):
        self.losses, self.grad_norms, self.sums = [], [], {}
        self.tokens = 0.0
        self.forwards = 0
        self.first_ratio_dev = 0.0
        self.ratio_dev = 0.0
        self.train_lps, self.gen_lps = [], []

    def add(self, metrics: dict, tokens: float) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.tokens += tokens

    def logps(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.train_lps:
            return torch.zeros(1), torch.zeros(1)
        return torch.cat(self.train_lps), torch.cat(self.gen_lps)


def minibatches(rollouts: list[Rollout], parts: int) -> list[list[int]]:
    """``parts`` contiguous slices of the rollouts, cut between groups (rollouts of one prompt) where
    the groups divide evenly, so each mini-batch's prompts are shared in its tree rows."""
    if parts == 1:
        return [list(range(len(rollouts)))]
    starts = [i for i in range(len(rollouts)) if i == 0 or rollouts[i].prompt_ids != rollouts[i - 1].prompt_ids]
    if starts and len(starts) % parts == 0:
        per = len(starts) // parts
        bounds = [starts[k * per] for k in range(parts)] + [len(rollouts)]
    else:
        bounds = [round(k * len(rollouts) / parts) for k in range(parts + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(parts)]


def train_window(
    stepper,
    b: MiniBatch,
    policy,
    loss,
    ref_model,
    device,
    acc: StepMetrics,
    label,
    *,
    first: bool,
    measure: bool,
) -> float:
    """One optimizer step over mini-batch ``b``; returns its gradient norm."""
    counts = b.counts(policy)
    count, tokens = global_sum(sum(counts)), global_sum(sum(float(m.sum()) for m in b.masks))
    local = [1.0] * len(b.rows)
    if policy.rank_local:  # bnpo: this rank's token mean, the ranks' means averaged
        mine = sum(counts)
        local = [count / (world_size() * mine) if mine else 0.0] * len(b.rows)
    step_loss = 0.0
    with stepper.window([{"n": c} for c in counts], "n", step=label) as window:
        for r, row in enumerate(b.rows):
            row = row.to(device)  # CPU rows (and their VarlenMeta) to the model
            with window.row():
                out, batch = _row_loss(stepper.model, row, r, b, policy, loss, ref_model, acc)
                total = objective(out, loss.policy, count, tokens) * local[r]
                if row.empty:
                    total = total * 0.0
                step_loss += float(window.backward(total))
            if row.empty:
                continue
            # the IS weights depend on the rollout alone: counted once, on the first pass
            acc.add(
                {k: v for k, v in out.metrics.items() if measure or not k.startswith("is/")}, float(batch.mask.sum())
            )
            dev = float((torch.exp(batch.logp.detach() - batch.old_logp) - 1).abs().max())
            acc.ratio_dev = max(acc.ratio_dev, dev)
            if first:
                acc.first_ratio_dev = max(acc.first_ratio_dev, dev)
            if measure and (first or b.old is not None):  # before any update: the mismatch report
                acc.train_lps.append(batch.old_logp if b.old is not None else batch.logp.detach())
                acc.gen_lps.append(batch.rollout_logp)
    acc.losses.append(step_loss)
    return window.grad_norm


def _row_loss(model, row, r: int, b: MiniBatch, policy, loss, ref_model, acc: StepMetrics):
    """The policy loss of one packed row and the pairs it was computed on."""
    entropy = bool(loss.policy.entropy_coef)
    with batch_invariant(loss.batch_invariant):  # the forward only; any correct backward will do
        scored = packed_logprobs(model, row, b.temperature, compute_entropy=entropy)
        acc.forwards += 1
    logp, ent = scored if entropy else (scored, None)
    gen_lp = row.token_values.get("gen_logprobs")
    if gen_lp is None or gen_lp.shape != logp.shape:
        have = "no" if gen_lp is None else gen_lp.numel()
        raise ValueError(
            f"a row has {logp.numel()} loss tokens but {have} generator log-probs; the GRPO "
            "loss needs every Rollout's gen_logprobs (the generator's, per sampled token)"
        )
    gen_lp = gen_lp.to(logp.device)
    if loss.old_logprobs == "rollout":
        old = gen_lp  # exact in the batch-invariant mode: the rollout's log-probs are the trainer's
    else:
        old = b.old[r].to(logp.device) if b.old is not None else logp.detach()
    ref_lp = None
    if ref_model is not None and loss.policy.beta:
        if r not in b.ref:
            with torch.no_grad(), batch_invariant(loss.batch_invariant):
                b.ref[r] = packed_logprobs(ref_model, row, b.temperature)
                acc.forwards += 1
        ref_lp = b.ref[r]
    seq = b.seqs[r].to(logp.device)
    batch = PolicyBatch(
        logp,
        old,
        b.advantages[r].to(logp.device),
        seq,
        len(row.indices),
        mask=b.masks[r].to(logp.device),
        ref_logp=ref_lp,
        rollout_logp=gen_lp,
        entropy=ent,
    )
    return policy(batch), batch
