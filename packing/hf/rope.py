"""Rotary scalings whose factors depend on the length of the whole call, not of each sequence.

LongRoPE (Phi-3.5 / Phi-4-mini) takes its long factors once the call's largest position passes
``original_max_position_embeddings``; dynamic NTK rescales once it passes the original context.
transformers decides from ``max(position_ids) + 1`` over everything in the forward. Alone, each
sequence decides by its own length; in a packed row, by the row's longest. So a row that holds a
sequence on each side of that length gives the short one the long factors: a different answer with
no error. Rows that keep every sequence on one side are exact, and are let through."""

from __future__ import annotations

import logging

from nopad.packing.model_config import text_config

logger = logging.getLogger(__name__)
SWITCHING_ROPE_TYPES = ("longrope", "dynamic")


def rope_switch_length(config) -> int | None:
    """The length past which ``config``'s rotary scaling switches, or None when it does not."""
    text = text_config(config)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kinds = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    for p in kinds:
        if isinstance(p, dict) and p.get("rope_type", p.get("type")) in SWITCHING_ROPE_TYPES:
            return int(
                p.get("original_max_position_embeddings")
                or getattr(text, "original_max_position_embeddings", None)
                or text.max_position_embeddings
            )
    return None


def check_row_lengths(config, lengths: tuple[int, ...] | None, tree: bool) -> str | None:
    """Why a row of sequences of ``lengths`` cannot run exactly under ``config``'s rotary scaling
    (None: it can). A tree row's paths are not its segments, so it must stay under the switch."""
    switch = rope_switch_length(config)
    if switch is None or not lengths or max(lengths) <= switch:
        return None
    if not tree and min(lengths) > switch:
        return None
    kind = (
        "a prefix-tree row with a path longer than that"
        if tree
        else f"a row of sequences of {min(lengths)} to {max(lengths)} tokens"
    )
    return (
        f"this model's rotary scaling switches its factors at {switch} tokens, judged over the whole "
        f"call (transformers: from the call's largest position), and {kind} would give its shorter "
        f"sequences the long factors. Pack rows whose sequences are all at most {switch} tokens (or all "
        "longer), or keep this model unpacked (docs/models.md)"
    )


def max_model_len(config) -> int:
    """The generator's longest sequence: the model's ``max_position_embeddings`` (unbounded if it
    gives none), and under the switch, where a step's longest sequence cannot switch the factors of
    the others (each is computed as it is alone), with a warning if that shortens the model's own."""
    own = int(getattr(config, "max_position_embeddings", None) or 1 << 62)
    switch = rope_switch_length(config)
    if switch is None or switch >= own:
        return own
    logger.warning(
        "this model's rotary scaling (LongRoPE / dynamic NTK) switches its factors at %d tokens "
        "by the longest sequence of a call; the Generator keeps every sequence under it "
        "(max_model_len %d, not %d) so each is computed as it is alone",
        switch,
        switch,
        own,
    )
    return switch
