"""GRPO, written once for the recipe and for ``NopadGRPOTrainer``: sampled completions
(:class:`Rollout`) -> packed varlen rows (:func:`pack_rollouts`) -> the training forward's
log-probs (:func:`packed_logprobs`), the group advantages, the clipped token loss and the choice
of batch-invariant numerics.

The rows are prefix-tree rows (:mod:`nopad.packing.bins.tree`): a group's prompt, and the earlier
turns that forked episodes share, are computed once.

Why one module: the rollout's log-probs equal the trainer's bitwise only if both sides pack and
score the same way; two copies had drifted before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nopad.packing.bins.tree import TreePath, pack_tree_rows
from nopad.packing.head.chunked import token_logprobs
from nopad.packing.row import IGNORE_INDEX, PackedRow, as_row
from nopad.packing.varlen import VarlenMeta

logger = logging.getLogger(__name__)


def resolve_batch_invariant(setting: bool | str, device: torch.device | str, key: str = "batch_invariant") -> bool:
    """``True`` / ``False`` / ``"auto"`` (on where :func:`nopad.packing.invariance_support.supported`, else off
    with a warning), for the setting called ``key`` (``train.batch_invariant`` in the recipe)."""
    if setting not in ("auto", True, False):
        raise ValueError(f"{key} must be 'auto', True or False, got {setting!r}")
    from nopad.packing.invariance_support import supported as invariant_mode_supported

    supported, why = invariant_mode_supported(device)
    if setting == "auto" and supported and torch.device(device).type != "cpu":
        # the Triton kernel set is proven under the interpreter, not yet timed on a GPU
        logger.warning(
            "%s='auto': off on %s until the Triton kernel set's cost is measured on a GPU "
            "(make gpu-check); set %s=True for bitwise-equal rollout and trainer log-probs",
            key,
            torch.device(device).type,
            key,
        )
        return False
    if setting == "auto":
        if not supported:
            logger.warning("%s='auto': off (%s); rollout and trainer log-probs will differ slightly", key, why)
        return supported
    if setting and not supported:
        raise ValueError(f"{key}=True is not available: {why}. Use {key}='auto' or False")
    return bool(setting)


def group_advantages(
    rewards: torch.Tensor, eps: float = 1e-4, scale_rewards: str = "group", batch_std: float | None = None
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over a std (TRL's ``scale_rewards``):
    the group's (``"group"``), the whole batch's (``"batch"``: ``batch_std``, or these rewards') or
    none (``"none"``, Dr. GRPO). ``rewards`` is ``(num_prompts, num_generations)``; a group with
    equal rewards gets zeros."""
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (num_prompts, num_generations >= 2), got {tuple(rewards.shape)}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "batch":
        std = rewards.std() if batch_std is None else torch.tensor(batch_std, dtype=rewards.dtype)
    else:
        std = rewards.std(dim=1, keepdim=True)
    return centred / (std + eps)


SCALE_REWARDS = ("group", "batch", "none")

# which policy GRPO trains: "tempered" softmax(logits / T), what the sampler drew from before any
# top-k/top-p filter (TRL's trainer and its IS ratio), or "raw" softmax(logits) (T = 1)
LOGPROBS = ("tempered", "raw")


def policy_temperature(logprobs: str, temperature: float) -> float:
    """The ``T`` of the trained policy ``softmax(logits / T)`` for rollouts sampled at
    ``temperature``: that temperature for ``"tempered"`` (TRL's), 1 for ``"raw"``; greedy rollouts
    (0) record the raw log-prob, so 1 too. Why one function: the rollout's recorded log-probs
    and every trainer forward (current, old, reference) must score the same policy."""
    if logprobs not in LOGPROBS:
        raise ValueError(f"logprobs must be one of {LOGPROBS}, got {logprobs!r}")
    return float(temperature) if logprobs == "tempered" and temperature > 0 else 1.0


def _sampled_logprobs(record, logprobs: str) -> list[float]:
    """The generator's log-probs of ``record``'s tokens under the trained policy (:data:`LOGPROBS`)."""
    if logprobs not in LOGPROBS:
        raise ValueError(f"logprobs must be one of {LOGPROBS}, got {logprobs!r}")
    return [float(x) for x in (record.temperature_logprobs if logprobs == "tempered" else record.logprobs)]


@dataclass
class Rollout:
    """One sampled completion: the RL record from the generator's output to the packed row. Each
    value is carried once, in the shape the loss reads it: the sampled tokens' log-probs one per
    loss token, the advantage one per completion (the loss expands it to its pairs,
    :func:`pair_advantages`). Build it from the generator with :meth:`from_completion` /
    :meth:`from_episode`."""

    prompt_ids: list[int]
    completion_ids: list[int]
    # the generator's log-prob of each token the model sampled (``loss_mask`` 1), in order, under the
    # trained policy (LOGPROBS: tempered by default); a list as long as the completion (an Episode's:
    # 0.0 at tool tokens) is filtered to those once, here.
    # Empty when another forward scores the completion (NopadGRPOTrainer: TRL's); the recipe's loss
    # then refuses the row
    gen_logprobs: Sequence[float] = ()
    reward: float = 0.0
    advantage: float = 0.0  # the completion's group advantage, one number
    # multi-turn episodes: 1 at each completion token the model sampled (trained on), 0 at tool
    # tokens (context only); empty: every completion token is the model's
    loss_mask: Sequence[int] = ()
    truncated: bool = False  # stopped by the token limit, not by the model (mask_truncated_completions)
    # per loss token, like gen_logprobs: the generator's policy version (optimizer step) that sampled it;
    # empty when unknown. Streaming RL's staleness is read here (nopad.training.streaming)
    policy_versions: Sequence[int] = ()

    def __post_init__(self) -> None:
        mask = _loss_mask(self)
        kept = sum(mask)
        if len(self.gen_logprobs) == len(mask) != kept:  # one per completion token: keep the sampled ones
            self.gen_logprobs = [lp for lp, keep in zip(self.gen_logprobs, mask) if keep]
        if len(self.policy_versions) == len(mask) != kept:
            self.policy_versions = [v for v, keep in zip(self.policy_versions, mask) if keep]

    @classmethod
    def from_completion(cls, prompt_ids: Sequence[int], completion, logprobs: str = "tempered") -> Rollout:
        """A plain sample (:class:`nopad.inference.outputs.CompletionOutput`): every token the model's.
        ``logprobs``: which recorded log-probs (:data:`LOGPROBS`), the trained policy's."""
        return cls(
            list(prompt_ids),
            list(completion.token_ids),
            _sampled_logprobs(completion, logprobs),
            truncated=completion.finish_reason == "length",
            policy_versions=list(getattr(completion, "policy_versions", ())),
        )

    @classmethod
    def from_episode(cls, episode, logprobs: str = "tempered") -> Rollout:
        """A multi-turn episode (:class:`nopad.inference.episodes.Episode`): the tools' tokens are context."""
        return cls(
            list(episode.prompt_token_ids),
            list(episode.completion_ids),
            _sampled_logprobs(episode, logprobs),
            loss_mask=list(episode.model_mask),
            truncated=episode.finish_reason == "length",
            policy_versions=list(getattr(episode, "policy_versions", ())),
        )

    @property
    def num_loss_tokens(self) -> int:
        """The completion tokens the model sampled: what the loss trains on."""
        return sum(self.loss_mask) if self.loss_mask else len(self.completion_ids)


def pack_rollouts(rollouts: list[Rollout], capacity: int, shared_prefix: bool = True) -> list[PackedRow]:
    """Pack rollouts into varlen rows. Only completion tokens carry the loss: labels are
    ``IGNORE_INDEX`` on prompts. Each row carries the rollout index of each completion
    (``indices``) and, per loss pair, the generator's log-probs (``token_values["gen_logprobs"]``,
    when the rollouts have them); the advantages stay on the rollouts (:func:`pair_advantages`).

    ``shared_prefix`` (default): the rollouts are the paths of a prefix tree
    (:mod:`nopad.packing.bins.tree`), so tokens that several rollouts share - a group's prompt, the
    earlier turns of forked episodes, a common start of completions - are computed once per row,
    and a shared completion token that m rollouts train on counts m times, each with its own
    advantage (the row's loss pairs). Never more tokens than flat packing
    (:func:`packing_metrics` says how many fewer). Else every rollout is its own
    prompt+completion sequence (BFD)."""
    if not rollouts:  # a rank with no prompts this step (its padding rows come from pad_rows)
        return []
    scored = _scored(rollouts)
    if shared_prefix:
        rows = pack_tree_rows(rollout_paths(rollouts), capacity)
    else:
        rows = _flat_rows(rollouts, capacity)
    if not scored:
        return rows
    # pairs are laid completion after completion (indices), each in token order: the sampled log-probs
    return [
        row.with_token_values({"gen_logprobs": [lp for i in row.indices.tolist() for lp in rollouts[i].gen_logprobs]})
        for row in rows
    ]


def _flat_rows(rollouts: list[Rollout], capacity: int) -> list[PackedRow]:
    from nopad.packing.bins.binpack import pack

    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    rows = []
    for indices in pack(lengths, capacity, strategy="bfd"):
        order = indices.tolist()
        ids, labels = [], []
        for i in order:  # an episode's tool tokens are context: no label (Rollout.loss_mask)
            prompt, completion = list(rollouts[i].prompt_ids), list(rollouts[i].completion_ids)
            ids += prompt + completion
            labels += [IGNORE_INDEX] * len(prompt) + [
                t if keep else IGNORE_INDEX for t, keep in zip(completion, _loss_mask(rollouts[i]))
            ]
        meta = VarlenMeta.from_lengths([lengths[i] for i in order])
        rows.append(PackedRow.build(ids, labels, meta, indices=order))
    return rows


def _loss_mask(r: Rollout) -> list[int]:
    """One 0/1 per completion token: 1 where the model sampled it (``Rollout.loss_mask``, empty: all)."""
    mask = list(r.loss_mask) if r.loss_mask else [1] * len(r.completion_ids)
    if len(mask) != len(r.completion_ids) or any(m not in (0, 1) for m in mask):
        raise ValueError(
            f"a rollout's loss_mask must hold one 0/1 per completion token "
            f"({len(r.completion_ids)}), got {len(mask)} values"
        )
    return mask


def rollout_paths(rollouts: Sequence[Rollout]) -> list[TreePath]:
    """Each rollout as a path of a prefix tree (``nopad.packing.bins.tree.TreePath``): prompt +
    completion, the loss on the tokens the model sampled."""
    return [
        TreePath(
            list(r.prompt_ids) + list(r.completion_ids), [False] * len(r.prompt_ids) + [bool(x) for x in _loss_mask(r)]
        )
        for r in rollouts
    ]


def pair_advantages(row: PackedRow, rollouts: Sequence[Rollout]) -> torch.Tensor:
    """float32 ``[pairs]``: the advantage of each loss pair of ``row`` (packed from ``rollouts``),
    its completion's one number expanded where the loss reads it; zeros on a filler row."""
    seqs = pair_sequences(row)
    if row.empty:
        return torch.zeros(seqs.numel())
    per_completion = torch.tensor([rollouts[i].advantage for i in row.indices.tolist()], dtype=torch.float32)
    return per_completion[seqs.cpu()]


def packing_metrics(rows: Sequence[PackedRow], rollouts: Sequence[Rollout]) -> dict[str, float]:
    """What packing saved: ``train_tokens`` the rows compute (filler rows excluded),
    ``flat_train_tokens`` the rollouts as flat sequences would, and ``tree_token_saving``, the
    share of those that shared prefixes spared (0 when nothing is shared)."""
    train = sum(r.num_tokens for r in rows if not r.empty)
    flat = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    return {"train_tokens": train, "flat_train_tokens": flat, "tree_token_saving": 1.0 - train / flat if flat else 0.0}


def empty_rollout_row() -> PackedRow:
    """A two-token row with one (zero-weight) loss token and no loss count: what a rank with fewer
    rows runs so that every rank joins the same forward/backward collectives."""
    return PackedRow.build(
        [0, 0],
        [IGNORE_INDEX, 0],
        VarlenMeta.from_lengths([2]),
        indices=[-1],
        token_values={"gen_logprobs": [0.0]},
        empty=True,
    )


def _scored(rollouts: Sequence[Rollout]) -> bool:
    """Whether the rollouts carry the generator's log-probs, one per loss token (all or none).
    Rollouts scored by another forward (``NopadGRPOTrainer``: TRL's) carry none: their rows then
    have no ``gen_logprobs``, and a loss that needs them refuses them."""
    scored = [bool(r.gen_logprobs) for r in rollouts]
    if any(scored) and not all(scored):
        raise ValueError("some rollouts carry generator log-probs and some do not; give all or none")
    for r in rollouts if all(scored) else ():
        if len(r.gen_logprobs) != r.num_loss_tokens:
            raise ValueError(
                f"a rollout has {len(r.gen_logprobs)} gen_logprobs for {r.num_loss_tokens} "
                f"sampled tokens ({len(r.completion_ids)} completion tokens); give one per "
                "sampled token, or one per completion token with its loss_mask"
            )
    return all(scored)


def packed_logprobs(
    model, row: Mapping, temperature: float = 1.0, *, compute_entropy: bool = False, entropy_grad: bool = True
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the loss pairs of one packed row under ``model`` (the training forward), in
    pair order (label order outside tree rows): ``log_softmax(logits / temperature)`` at each
    sampled token. With ``compute_entropy`` returns ``(logps, entropies)`` (the entropies
    differentiable only with ``entropy_grad``). Only the positions that predict a loss token go
    through the LM head (:meth:`PackedRow.loss_tokens`; in a tree row a completion's first token is
    predicted by its prompt's last token), once per token however many pairs read it, in chunks
    (:func:`nopad.packing.head.chunked.token_logprobs`: the row's ``T x V`` logits never exist)."""
    row = as_row(row)
    predict_at, targets = row.loss_tokens()
    logps, entropies = token_logprobs(
        model, row.model_kwargs(), predict_at, targets, temperature=temperature, entropy=compute_entropy
    )
    logps = row.per_pair(logps)
    if not compute_entropy:
        return logps
    if not (entropy_grad and torch.is_grad_enabled()):
        entropies = entropies.detach()
    return logps, row.per_pair(entropies)


def pair_sequences(row: PackedRow) -> torch.Tensor:
    """The sequence (an index into ``row.indices``) of each loss pair of ``row``, in pair order:
    what a sequence-level loss or IS mode groups the pairs by."""
    if row.pair_seqs is not None:
        return row.pair_seqs
    targets_at = torch.nonzero(row.labels[0] != IGNORE_INDEX).squeeze(1)
    ends = row.nopad_meta.cu_seqlens_q[1:].to(device=targets_at.device, dtype=torch.long)
    return torch.searchsorted(ends, targets_at, right=True)
