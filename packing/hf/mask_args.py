"""transformers' mask builder without its search for packed sequences under nopad attention.

``create_causal_mask`` (and the sliding-window and chunked masks) look for packed sequences in
``position_ids`` whenever no 2-D mask and no cache is given, which is every nopad call, and decide
with ``(mask[:, -1] == 0).all()`` read on the host: a device->host sync in every eager forward (on
CUDA the host waits there for the GPU to drain its queue before it launches a layer). nopad's mask
hook (:func:`nopad.packing.hf.attention.nopad_mask`) never reads that mask: the boundaries come from
``nopad_meta``, or from ``position_ids`` in the layers. So under nopad attention the mask is built
without ``position_ids``; under any other attention transformers runs as it does. Installed with the
other patches (:mod:`nopad.packing.mixers.patches`), on first use.
"""

from __future__ import annotations

import functools
import sys

from nopad.packing.mixers.support import NOPAD_ATTENTION

_MARK = "_nopad_mask_args"


def install() -> None:
    """Wrap ``masking_utils._preprocess_mask_arguments`` (idempotent)."""
    from transformers import masking_utils

    original = masking_utils._preprocess_mask_arguments
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def preprocess(config, inputs_embeds, attention_mask, cache, position_ids=None, *args, **kwargs):
        if config._attn_implementation == NOPAD_ATTENTION:
            position_ids = None  # only the packed-sequence search reads them; nopad's mask hook ignores it
        return original(config, inputs_embeds, attention_mask, cache, position_ids, *args, **kwargs)

    setattr(preprocess, _MARK, True)
    masking_utils._preprocess_mask_arguments = preprocess


def uninstall() -> None:
    """Give transformers its own function back (tests; the next use installs again)."""
    masking_utils = sys.modules.get("transformers.masking_utils")
    wrapped = getattr(masking_utils, "_preprocess_mask_arguments", None)
    if getattr(wrapped, _MARK, False):
        masking_utils._preprocess_mask_arguments = wrapped.__wrapped__
