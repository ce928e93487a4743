"""The LM head, written once for the trainer and the generator: hidden states at the positions that
need them -> the log-prob of one chosen token each (and the entropy when asked), chunked over
tokens and recomputed in backward, so a packed row never holds its ``T x V`` logits.

    logps, entropies = token_logprobs(model, row.model_kwargs(), predict_at, targets, entropy=True)

Why: with vocabularies of 150k-262k, one 8,192-token row of fp32 logits is 5-8 GB, before
``log_softmax`` and its backward copy it. Here the backbone runs once (the model's own forward,
so DDP / DeepSpeed / FSDP / peft wrappers and their hooks all see an ordinary call) with the head
given one row only, and the head then runs on :data:`CHUNK_TOKENS` positions at a time, inside
that call (where ZeRO-3 and FSDP2 have gathered its weights): peak memory is O(chunk x V), not
O(T x V) (``benchmarks/bench_lm_head.py`` measures it). A plain ``nn.Linear`` head takes its
gradients by hand (:mod:`nopad.packing.head.linear`: one fp32 weight-gradient buffer, and for the SFT
loss, :func:`nll_sum`, in the forward pass, so no recompute); any other head module goes through
autograd over checkpointed chunks.

Exact, not fused: each chunk is the model's own head module (tied embeddings, a bias, a peft LoRA
on ``lm_head`` run as they do in the model), the model's own final-logit ops (:class:`LMHead`:
Gemma's softcap, Granite's and Cohere's scales; :mod:`nopad.packing.head.model_head`), checked at every
call against the model's logits of one position; a model that fails the check is scored from its own
logits, with a warning), then :func:`tempered_log_softmax` gathered at the target: the function the generator's sampler
computes its log-probs with, so under :func:`nopad.packing.batch_invariant` (whose
linear and log-softmax are row-local) the chunking changes no bit, and the chunks start at token
0 with a fixed size whatever the number of tokens.

Why not torch's ``F.linear_cross_entropy`` (torch 2.13): it takes a weight and a bias, not the
head module, so a LoRA adapter on ``lm_head``, a softcap or a logit scale cannot go through it; it
returns the NLL alone (no entropy); and its chunked path sizes chunks from the batch's row count
unless one is fixed. Using it for the plain case would be a second copy of the math, which is
what drifts (TRL#7063, verl#2656), so nopad has this one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from nopad.packing.head.linear import LinearHeadChunks, LinearHeadNLL
from nopad.packing.head.log_softmax import logits_grad, picked_and_entropy, tempered_log_softmax
from nopad.packing.head.model_head import LMHead, head_mismatch, head_of, unwrap
from nopad.packing.invariance import active_kernels, batch_invariant, is_enabled

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 128  # head rows per chunk; fixed, so chunk bounds never depend on the row's length


def token_logprobs(
    model: torch.nn.Module,
    model_kwargs: dict[str, Any],
    positions: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-prob of ``targets[i]`` predicted at row position ``positions[i]`` (and the entropy
    there when asked) under ``model``, fp32, for one packed row (``model_kwargs``: its
    ``input_ids``, ``position_ids``, ``nopad_meta``), from one call of ``model``.

    The chunked head (:func:`head_logprobs`) runs *inside* that call, in hooks on the head module:
    its input is kept and the module itself computes one row; then, while ZeRO-3 or FSDP2 still
    hold its gathered weights, the chunks score the kept hidden states. Their result is tied into
    the head's output and the model's logits (:class:`_Tied`), so backward passes the engines'
    pre-backward hooks (which gather the weights again) before it reaches the chunks' recompute.
    The one row of the model's logits is checked against :meth:`LMHead.finish` of the head's own
    output, so a model whose forward does something after its head that :func:`head_of` does not
    read fails here instead of training on wrong log-probs."""

    def score(head: LMHead, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return head_logprobs(
            head, hidden, targets, temperature=temperature, entropy=entropy, chunk_tokens=chunk_tokens, hooks=False
        )

    scores, mismatch = _score_in_model_call(model, model_kwargs, positions, score)
    if mismatch:
        return _from_full_logits(model, model_kwargs, positions, targets, temperature, entropy, mismatch)
    return scores[0], scores[1]


def nll_sum(
    model: torch.nn.Module,
    model_kwargs: dict[str, Any],
    positions: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``-(weights * logps).sum()`` of :func:`token_logprobs`'s ``logps`` (temperature 1): the SFT
    loss of one packed row, with the same values. Why a function of its own: the gradient of a
    scalar loss is known, up to its one scale, in the forward pass, so a plain ``nn.Linear`` head
    (:class:`~nopad.packing.head.linear.LinearHeadNLL`) takes each chunk's gradients there, while its logits
    exist: three ``T x H x V`` GEMMs, as the full-logits path runs, instead of four with a recompute."""
    weights = weights.to(targets.device)
    if weights.shape != targets.shape:
        raise ValueError(
            f"weights of shape {tuple(weights.shape)}, targets of shape {tuple(targets.shape)}: one weight per target"
        )

    def score(head: LMHead, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return head_nll_sum(head, hidden, targets, weights, chunk_tokens=chunk_tokens, hooks=False), None

    scores, mismatch = _score_in_model_call(model, model_kwargs, positions, score)
    if mismatch:
        logps, _ = _from_full_logits(model, model_kwargs, positions, targets, 1.0, False, mismatch)
        return -(weights.to(logps.device) * logps).sum()
    return scores[0]


def _score_in_model_call(model, model_kwargs, positions, score) -> tuple[tuple, str | None]:
    """``score(head, hidden)`` (a pair of tensors, the second maybe None) of the hidden states at
    ``positions``, from one call of ``model``, and why the model's logits cannot be trusted to be
    the head's (None: they can).

    ``score`` runs *inside* that call, in hooks on the head module: its input is kept and the
    module itself computes one row; then, while ZeRO-3 or FSDP2 still hold its gathered weights,
    the chunks score the kept hidden states. Their result is tied into the head's output and the
    model's logits (:class:`_Tied`), so backward passes the engines' pre-backward hooks (which
    gather the weights again) before it reaches the chunks' backward. The one row of the model's
    logits is checked against :meth:`LMHead.finish` of the head's own output, so a model whose
    forward does something after its head that :func:`head_of` does not read is found here
    instead of training on wrong log-probs."""
    head = head_of(model)
    state: dict[str, Any] = {}

    def keep_hidden(module, args, kwargs):
        state["hidden"] = args[0]
        return (args[0][..., :1, :], *args[1:]), kwargs

    def score_chunks(module, args, kwargs, output):
        if "scores" in state:
            raise RuntimeError(
                f"{type(unwrap(model)).__name__}'s forward called its output embeddings "
                "twice; the LM head needs the usual causal-LM forward: backbone, then head"
            )
        hidden = state.pop("hidden")
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if hidden.shape[0] != positions.numel():
            raise RuntimeError(
                f"{type(unwrap(model)).__name__}'s head got {hidden.shape[0]} positions, not "
                f"logits_to_keep's {positions.numel()}: the LM head needs a causal LM that "
                "takes logits_to_keep as a tensor of positions"
            )
        with torch.no_grad():
            state["ours"] = head.finish(output.reshape(-1, output.shape[-1])[:1])
        state["scores"] = scores = score(head, hidden)
        return _Tied.apply(output.detach(), *_present(*scores))[0]

    # keep_hidden runs after the engines' pre-hooks (it keeps the input they wrap for backward),
    # score_chunks before their post-hooks (the weights are still gathered; they wrap its output)
    handles = [
        head.module.register_forward_pre_hook(keep_hidden, with_kwargs=True),
        head.module.register_forward_hook(score_chunks, with_kwargs=True, prepend=True),
    ]
    try:
        out = model(**model_kwargs, logits_to_keep=positions, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if "scores" not in state:
        raise RuntimeError(
            f"{type(unwrap(model)).__name__}'s forward did not call its output embeddings "
            "(get_output_embeddings()); the LM head needs the usual causal-LM forward"
        )
    first, second = state["scores"]
    if positions.numel():
        theirs = out.logits.reshape(-1, out.logits.shape[-1])[:1]
        mismatch = head_mismatch(head, state["ours"], theirs, model)
        if mismatch:
            return (first, second), mismatch
    tied = _Tied.apply(out.logits, *_present(first, second))[1:]
    return (tied[0], (tied[1] if second is not None else None)), None


def _present(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


class _Tied(torch.autograd.Function):
    """The tensors unchanged, as one autograd node: backward waits for all of their gradients (an
    unused one is zero) and passes each back to its own graph. Tying the chunks' scores to the
    head's output, and the model's logits to the scores, makes backward go through the logits'
    pre-backward hooks (ZeRO-3's and FSDP2's weight gathering) before the chunks' recompute."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return grads


_warned: set[str] = set()


def _from_full_logits(model, model_kwargs, positions, targets, temperature, entropy, why: str):
    """The fallback for a model whose logits the chunked head cannot reproduce: the model's own
    logits at ``positions`` (``(N, V)`` of them), through the same log-softmax. Logged once per
    model class, since it costs the memory the chunks save."""
    name = type(unwrap(model)).__name__
    if name not in _warned:
        _warned.add(name)
        logger.warning(
            "%s; scoring from its full logits at the loss positions instead (N x V memory). "
            "Add the op to nopad.packing.head.model_head.LMHead, or change the hidden states (a hook on the "
            "final norm), to get the chunked head back",
            why,
        )
    logits = model(**model_kwargs, logits_to_keep=positions, use_cache=False).logits
    logits = logits.reshape(-1, logits.shape[-1])
    logps, ents = _TargetLogprobs.apply(logits, targets.to(logits.device), entropy, temperature)
    return logps, (ents if entropy else None)


class _TargetLogprobs(torch.autograd.Function):
    """:func:`tempered_log_softmax` of logits ``z`` gathered at ``targets`` (and the entropy of each
    row), saving only the log-softmax for backward, whose gradient is written into one ``(rows, V)``
    buffer in place."""

    @staticmethod
    def forward(ctx, z, targets, want_entropy, temperature):
        logp = tempered_log_softmax(z, temperature)
        picked, ent = picked_and_entropy(logp, targets, want_entropy)
        ctx.save_for_backward(logp, targets, ent)
        ctx.want_entropy, ctx.temperature = want_entropy, temperature
        return picked, ent

    @staticmethod
    def backward(ctx, g_picked, g_ent):
        logp, targets, ent = ctx.saved_tensors
        ent = ent if ctx.want_entropy else None
        grad = logits_grad(logp, targets, ent, g_picked, g_ent, ctx.temperature)
        return grad, None, None, None  # autograd casts the fp32 gradient to z's dtype


def _chunk(
    head: LMHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    invariant: tuple[bool, str | None],
    hooks: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the recompute in backward runs the forward's numerics (batch-invariant or not), whatever mode
    # the backward is called in: the same ops, so the same tensors saved and the same logits
    with batch_invariant(*invariant):
        return _TargetLogprobs.apply(head.logits(hidden, hooks=hooks), targets, want_entropy, temperature)


def check_temperature(temperature: float) -> None:
    """The trainer's temperature divides the logits: 0 gives NaN log-probs and a negative one
    reverses the distribution, both without an error of their own."""
    try:
        value = float(temperature)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < float("inf"):  # NaN fails both comparisons
        raise ValueError(
            f"temperature must be a finite number > 0 (the logits are divided by it; 1.0: the "
            f"model's own distribution), got {temperature!r}; a greedy rollout (temperature 0) "
            "is scored at temperature 1.0"
        )


def head_logprobs(
    head: LMHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
    hooks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(log-probs of targets, entropies or None)`` of ``hidden`` ``(N, H)`` under
    ``softmax(head.logits(hidden) / temperature)``, computed ``chunk_tokens`` rows at a time from
    row 0; with grad enabled each chunk's logits are recomputed in backward (activation
    checkpointing), so no ``(N, V)`` tensor is ever kept. ``chunk_tokens`` None: :data:`CHUNK_TOKENS`.
    ``hooks``: as in :meth:`LMHead.logits` (:func:`token_logprobs` runs the chunks inside the
    model's call, without the head module's own hooks)."""
    check_temperature(temperature)
    chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"{hidden.shape[0]} hidden states but targets of shape {tuple(targets.shape)}")
    targets = targets.to(hidden.device)
    if hidden.shape[0] == 0:  # still connected to the model and the head, so backward reaches every
        # parameter (DDP and ZeRO wait for a gradient of each, even a zero one)
        zero = hidden.sum() * 0.0 + head.logits(hidden, hooks=hooks).sum() * 0.0
        empty = zero.float().expand(0)
        return empty, (empty if entropy else None)
    invariant = (is_enabled(), active_kernels())
    if torch.is_grad_enabled() and _plain(head, hooks):
        logps, ents = LinearHeadChunks.apply(
            hidden, head.module.weight, head.module.bias, targets, head, temperature, entropy, chunk_tokens, invariant
        )
        return logps, (ents if entropy else None)
    return _chunks(
        head,
        hidden,
        targets,
        temperature,
        entropy,
        chunk_tokens,
        invariant,
        hooks,
        checkpointed=torch.is_grad_enabled(),
    )


def _chunks(
    head: LMHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
    chunk_tokens: int,
    invariant: tuple[bool, str | None],
    hooks: bool,
    *,
    checkpointed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunks' scores in order from row 0, each chunk checkpointed (recomputed in backward by
    autograd) when ``checkpointed``."""
    parts, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if checkpointed:
            lp, ent = checkpoint(_chunk, head, h, t, temperature, entropy, invariant, hooks, use_reentrant=False)
        else:
            lp, ent = _chunk(head, h, t, temperature, entropy, invariant, hooks)
        parts.append(lp)
        ents.append(ent)
    logps = torch.cat(parts)
    return logps, (torch.cat(ents) if entropy else None)


def head_nll_sum(
    head: LMHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    hooks: bool = True,
) -> torch.Tensor:
    """``-(weights * logps).sum()`` of :func:`head_logprobs`'s ``logps`` (temperature 1); for a
    plain ``nn.Linear`` head with grad enabled, its gradients taken in the forward
    (:class:`nopad.packing.head.linear.LinearHeadNLL`)."""
    chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if torch.is_grad_enabled() and hidden.shape[0] and chunk_tokens >= 1 and _plain(head, hooks):
        if targets.shape != hidden.shape[:1]:
            raise ValueError(f"{hidden.shape[0]} hidden states but targets of shape {tuple(targets.shape)}")
        invariant = (is_enabled(), active_kernels())
        return LinearHeadNLL.apply(
            hidden,
            head.module.weight,
            head.module.bias,
            targets.to(hidden.device),
            weights.to(hidden.device),
            head,
            chunk_tokens,
            invariant,
        )
    logps, _ = head_logprobs(head, hidden, targets, chunk_tokens=chunk_tokens, hooks=hooks)
    return -(weights.to(logps.device) * logps).sum()


def _plain(head: LMHead, hooks: bool) -> bool:
    """Whether :mod:`nopad.packing.head.linear` computes this head: an ``nn.Linear`` itself (not a LoRA
    wrapper or a subclass), run without its module hooks (inside the model's call)."""
    return not hooks and type(head.module) is torch.nn.Linear
