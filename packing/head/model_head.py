"""The model's LM head as nopad computes it: its output embedding module and the final-logit ops the
model's forward applies after it (:class:`LMHead`), read from the model in one place (:func:`head_of`),
and the check that the model's own logits are exactly those (:func:`head_mismatch`). The chunked head
(:mod:`nopad.packing.head.chunked`) and the generator's prompt log-probs score through it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nopad.packing.model_config import text_config


@dataclass(frozen=True)
class LMHead:
    """The model's output embedding module and the final-logit ops its forward applies after it,
    in the model's order: ``* multiplier`` (Cohere ``logit_scale``, Falcon-H1
    ``lm_head_multiplier``), ``/ divisor`` (Granite ``logits_scaling``), then the softcap
    (Gemma2/3/4 ``final_logit_softcapping``: ``tanh(x / cap) * cap``)."""

    module: torch.nn.Module
    softcap: float | None = None
    multiplier: float | None = None
    divisor: float | None = None

    @property
    def final_ops(self) -> bool:
        """Whether :meth:`finish` does anything (else the logits are the module's output)."""
        return (self.softcap, self.multiplier, self.divisor) != (None, None, None)

    def logits(self, hidden: torch.Tensor, *, hooks: bool = True) -> torch.Tensor:
        """The model's logits of ``hidden``, op for op as its forward computes them. ``hooks``
        False runs the module's ``forward`` without its own hooks (inside the model's call, where
        the engines' hooks of this module have already gathered its weights)."""
        return self.finish(self.module(hidden) if hooks else self.module.forward(hidden))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The final-logit ops on the module's output ``x``."""
        if self.multiplier is not None:
            x = x * self.multiplier
        if self.divisor is not None:
            x = x / self.divisor
        if self.softcap is not None:
            x = x / self.softcap
            x = torch.tanh(x)
            x = x * self.softcap
        return x


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside a DDP / DeepSpeed engine wrapper (peft models answer for themselves)."""
    while not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def head_of(model: torch.nn.Module) -> LMHead:
    """The :class:`LMHead` of an HF causal LM (or a wrapper of one), read from its config and
    modules in one place."""
    lm = unwrap(model)
    module = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if module is None:
        raise ValueError(
            f"{type(lm).__name__} has no output embeddings (get_output_embeddings() is None); "
            "the LM head needs a causal LM with a head module"
        )
    config = text_config(lm.config)
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(lm, "final_logit_softcapping", None)
    multiplier = getattr(lm, "logit_scale", None)  # Cohere: set from config.logit_scale on the model
    inner = getattr(lm, "model", None)
    if multiplier is None and inner is not None:
        multiplier = getattr(inner, "lm_head_multiplier", None)  # Falcon-H1
    divisor = getattr(config, "logits_scaling", None)  # Granite
    if not isinstance(multiplier, (int, float)):
        multiplier = None
    return LMHead(module, softcap=softcap, multiplier=multiplier, divisor=divisor)


def head_mismatch(head: LMHead, ours: torch.Tensor, theirs: torch.Tensor, model) -> str | None:
    """Why the model's logits are not :meth:`LMHead.finish` of its head's output, or None. The same
    ops on the same row give the same bits; a few ulps of the compute dtype are allowed (autocast,
    kernels that differ by call site), nothing like a missing scale or softcap. Non-finite entries
    are not compared: a NaN or inf row is nopad's own non-finite error later."""
    with torch.no_grad():
        eps = max(torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0 for t in (ours, theirs))
        ours, theirs = ours.float(), theirs.float()
        finite = ours.isfinite() & theirs.isfinite()
        if not bool(finite.any()):
            return None
        scale = float(theirs[finite].abs().max())
        err = float((ours - theirs)[finite].abs().max())
    if err <= 4 * eps * scale:
        return None
    return (
        f"{type(unwrap(model)).__name__}'s logits differ from its head's output by up to {err:.3g} "
        f"(logits up to {scale:.3g}) after the final-logit ops nopad reads ({head.multiplier=}, "
        f"{head.divisor=}, {head.softcap=}): its forward (or a hook on it or its lm_head) transforms the "
        "logits in a way nopad.packing.head.chunked does not know"
    )
