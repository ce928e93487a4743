"""The transformers nopad was written against, checked once per process on first use.

nopad reaches into transformers where no public API serves it: it rebinds the kernel hook
``use_kernel_func_from_hub_with_fallback`` and the kernel globals of the hybrid and Mamba2 model
modules (:mod:`nopad.packing.mixers.hf_kernels`, :mod:`nopad.packing.mixers.mamba2`), reads and sets the
config's private ``_attn_implementation``, reads ``_is_stateful``, registers into
``AttentionInterface`` / ``AttentionMaskInterface``, reads model source code (which modules call
the attention interface, pass sinks, hand their ``**kwargs`` to the kernels) and overrides the
``Trainer``'s ``_prepare_inputs``. transformers changes such names between minor releases without
notice, and several changes would not fail but compute wrong: a kernel global renamed is one
nopad no longer wraps, so a packed row's sequences mix in it.

So every one of them is listed in :data:`TOUCHED` (what, where, how it is checked), and
:func:`check` checks them against the installed transformers once per process, where nopad first
touches it (registering the ``"nopad"`` attention, installing the patches, checking a model,
building a trainer). A transformers outside :data:`TESTED_TRANSFORMERS` (the pin in
``pyproject.toml``) is refused with one line naming the version, the range and what differs.
``NOPAD_ALLOW_UNTESTED_TRANSFORMERS=1`` runs an untested version whose checked names all match
(a warning instead of the refusal); a mismatch is always an error. Public config fields nopad reads
(``num_hidden_layers``, ``layer_types``...) are not listed: they are the models' documented API.

Imports nothing of nopad: the mixers below ``nopad.packing.hf`` call it too.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)

TESTED_TRANSFORMERS = ">=5.24,<5.25"  # keep equal to the pin in pyproject.toml
ALLOW_UNTESTED_ENV = "NOPAD_ALLOW_UNTESTED_TRANSFORMERS"
SHOWN = 3  # differences named in the refusal; problems() lists them all

# how a name is checked
ATTRIBUTE = "attribute"  # getattr(module, name) exists
INSTANCE = "instance attribute"  # an instance of the class built without arguments has it
PARAMETERS = "parameters"  # a callable whose signature has these parameters ("**kwargs": any keyword)
KERNEL = "kernel function"  # a global made by the kernel hook (``__wrapped__``), with these parameters
SOURCE = "source"  # inspect.getsource contains each of these strings
# modules imported only to check them when nopad's user imported them already (seconds to import)
LAZY_MODULES = ("transformers.trainer",)


@dataclass(frozen=True)
class Touch:
    """One thing of transformers nopad relies on: ``name`` (``Class.attribute`` or a global) in
    ``module``, checked ``how``, needing ``needs``; ``by`` is the (first) nopad module touching it."""

    module: str
    name: str
    how: str
    needs: tuple[str, ...] = ()
    by: str = ""


_MU, _MASK, _HUB = "transformers.modeling_utils", "transformers.masking_utils", "transformers.integrations"
_GDN = "transformers.models.qwen3_next.modeling_qwen3_next"
_KDA = "transformers.models.kimi_linear.modeling_kimi_linear"
_LLAMA = "transformers.models.llama.modeling_llama"
_CONV = ("hidden_states", "weight", "bias", "activation", "**kwargs")
_RULE = (
    "query",
    "key",
    "value",
    "g",
    "beta",
    "initial_state",
    "output_final_state",
    "use_qk_l2norm_in_kernel",
    "**kwargs",
)
_HK, _M2, _SUP = "nopad.packing.mixers.hf_kernels", "nopad.packing.mixers.mamba2", "nopad.packing.mixers.support"
_HF = "nopad.packing.hf.attention"  # the first user of a name; also verification, boundary_probe, mamba2

# modeling module -> its Mamba2 mixer class (nopad.packing.mixers.mamba2.FAMILIES)
MAMBA2_FAMILIES = {
    "transformers.models.nemotron_h.modeling_nemotron_h": "NemotronHMamba2Mixer",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "transformers.models.bamba.modeling_bamba": "BambaMixer",
    "transformers.models.falcon_h1.modeling_falcon_h1": "FalconH1Mixer",
}
# each Mamba2 kernel global nopad rebinds or calls -> the parameters it relies on
MAMBA2_GLOBALS = {
    "causal_conv1d_fn": _CONV,
    "mamba2_chunk_scan": (
        "hidden_states",
        "dt",
        "A",
        "B",
        "C",
        "chunk_size",
        "initial_states",
        "return_final_states",
        "**kwargs",
    ),
    "mamba2_split_conv1d_scan_combined": ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "**kwargs"),
    "mamba2_selective_state_update": (
        "state",
        "hidden_states",
        "dt",
        "A",
        "B",
        "C",
        "D",
        "dt_bias",
        "dt_softplus",
        "z",
    ),
}
_MAMBA2_CALLS = ("causal_conv1d_fn(", "mamba2_chunk_scan(", "mamba2_split_conv1d_scan_combined(", "**kwargs")

TOUCHED: tuple[Touch, ...] = (
    # the attention implementation: registered, switched, read back
    Touch("transformers.configuration_utils", "PreTrainedConfig._attn_implementation", INSTANCE, by=_HF),
    Touch(_MU, "PreTrainedModel.set_attn_implementation", PARAMETERS, ("attn_implementation",), by=_HF),
    # what set_attn_implementation writes in each config: the generator's later switches write it too
    Touch(
        "transformers.configuration_utils",
        "PreTrainedConfig._attn_implementation_internal",
        INSTANCE,
        by="nopad.inference.live_model",
    ),
    Touch("transformers", "AttentionInterface.register", PARAMETERS, ("key", "value"), by=_HF),
    Touch(_MASK, "AttentionMaskInterface.register", PARAMETERS, ("key", "value"), by=_HF),
    # nopad_mask is the forward's mask hook: picked by the config's implementation, given the 2-D mask
    Touch(
        _MASK,
        "create_causal_mask",
        SOURCE,
        ("ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]", "attention_mask=attention_mask"),
        by="nopad.packing.hf.attention",
    ),
    # the mask builder's argument step, wrapped (nopad.packing.hf.mask_args): its packed-sequence search syncs
    Touch(
        _MASK,
        "_preprocess_mask_arguments",
        PARAMETERS,
        ("config", "inputs_embeds", "attention_mask", "cache", "position_ids"),
        by="nopad.packing.hf.mask_args",
    ),
    Touch(
        _MASK,
        "create_causal_mask",
        SOURCE,
        ("_preprocess_mask_arguments(config, inputs_embeds, attention_mask, cache, position_ids",),
        by="nopad.packing.hf.mask_args",
    ),
    # the contract of a model call: positions and the attention keyword arguments reach every layer
    Touch(
        _LLAMA,
        "LlamaForCausalLM.forward",
        PARAMETERS,
        ("input_ids", "position_ids", "cache", "use_cache", "labels", "**kwargs"),
        by="nopad.packing.hf.packed_call",
    ),
    Touch(_LLAMA, "LlamaAttention.forward", SOURCE, ("ALL_ATTENTION_FUNCTIONS", "**kwargs"), by=_SUP),
    Touch(
        "transformers.models.gpt_oss.modeling_gpt_oss",
        "GptOssAttention.forward",
        SOURCE,
        ("s_aux=",),
        by="nopad.packing.mixers.sinks",
    ),
    # the model scan: stateful classes, and the models among the live objects (gc.get_objects)
    Touch(_MU, "PreTrainedModel._is_stateful", ATTRIBUTE, by=_SUP),
    Touch(_MU, "PreTrainedModel", ATTRIBUTE, by=_SUP),
    # the kernel hook nopad wraps, and the kernel globals it wraps in the hybrid model modules
    Touch(
        f"{_HUB}.hub_kernels",
        "use_kernel_func_from_hub_with_fallback",
        PARAMETERS,
        ("func_name", "package", "internal_path"),
        by=_HK,
    ),
    Touch(_HUB, "use_kernel_func_from_hub_with_fallback", ATTRIBUTE, by=_HK),
    Touch(_GDN, "causal_conv1d_fn", KERNEL, _CONV, by=_HK),
    Touch(_GDN, "causal_conv1d_update", KERNEL, ("hidden_states", "conv_state", "weight"), by=_HK),
    Touch(_GDN, "torch_chunk_gated_delta_rule", KERNEL, (*_RULE, "chunk_size"), by=_HK),
    Touch(_GDN, "torch_recurrent_gated_delta_rule", KERNEL, _RULE, by=_HK),
    Touch(
        _GDN,
        "Qwen3NextGatedDeltaNet.forward",
        SOURCE,
        ("causal_conv1d_fn(", "torch_chunk_gated_delta_rule(", "**kwargs"),
        by=_HK,
    ),
    Touch(_KDA, "chunk_kimi_delta_attention", KERNEL, (*_RULE, "chunk_size"), by=_HK),
    Touch(_KDA, "recurrent_kimi_delta_attention", KERNEL, _RULE, by=_HK),
    Touch(_KDA, "KimiLinearDeltaAttention.forward", SOURCE, ("chunk_kimi_delta_attention(", "**kwargs"), by=_HK),
    # the Mamba2 families: the mixer, the kernel globals rebound or called, the mask hook
    *(
        touch
        for module, mixer in MAMBA2_FAMILIES.items()
        for touch in (
            Touch(module, mixer, ATTRIBUTE, by=_M2),
            Touch(module, f"{mixer}.forward", SOURCE, _MAMBA2_CALLS, by=_M2),
            *(Touch(module, name, KERNEL, needs, by=_M2) for name, needs in MAMBA2_GLOBALS.items()),
            Touch(module, "create_recurrent_attention_mask", PARAMETERS, ("config", "**kwargs"), by=_M2),
        )
    ),
    # the Trainer nopad's packed loader sits in (nopad.training.trainer overrides these)
    Touch("transformers.trainer", "Trainer._prepare_inputs", PARAMETERS, ("inputs",), by="nopad.training.trainer"),
    Touch(
        "transformers.trainer",
        "Trainer.compute_loss",
        PARAMETERS,
        ("model", "inputs", "return_outputs", "num_items_in_batch"),
        by="nopad.training.trainer",
    ),
)


# ----------------------------------------------------------------------------- the checks
def _resolve(module, name: str):
    value = module
    for part in name.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def _parameters(function) -> set[str]:
    params = inspect.signature(inspect.unwrap(function)).parameters.values()
    return {"**kwargs" if p.kind is p.VAR_KEYWORD else p.name for p in params}


def problem(touch: Touch) -> str | None:
    """What differs about one listed name in the installed transformers (None: as nopad needs it)."""
    where = f"{touch.module}.{touch.name}"
    try:
        module = importlib.import_module(touch.module)
    except ImportError:
        return f"{touch.module} is gone"
    if touch.how == INSTANCE:
        owner, _, attribute = touch.name.rpartition(".")
        cls = _resolve(module, owner)
        return None if cls is not None and hasattr(cls(), attribute) else f"{where} is gone"
    value = _resolve(module, touch.name)
    if value is None:
        return f"{where} is gone"
    if touch.how == KERNEL and not hasattr(value, "__wrapped__"):
        return f"{where} is no longer made by the kernel hook"
    if touch.how in (PARAMETERS, KERNEL):
        missing = [p for p in touch.needs if p not in _parameters(value)]
        return f"{where} takes no {', '.join(missing)}" if missing else None
    if touch.how == SOURCE:
        try:
            source = inspect.getsource(value)
        except (OSError, TypeError):
            return f"the source of {where} is not readable"
        missing = [s for s in touch.needs if s not in source]
        return f"{where} no longer has {', '.join(repr(s) for s in missing)}" if missing else None
    return None


def problems(touches: tuple[Touch, ...] = TOUCHED) -> list[str]:
    """Every difference between the installed transformers and what nopad relies on."""
    return [p for p in map(problem, touches) if p is not None]


class UntestedTransformersError(RuntimeError):
    """The installed transformers is outside the tested range, or differs where nopad reaches into it."""


def installed_transformers() -> str:
    import transformers

    return transformers.__version__


def refuse_untested(found: list[str]) -> None:
    """Raise one line naming the version, the tested range and what differs; or, for an untested
    version with no difference, warn when ``NOPAD_ALLOW_UNTESTED_TRANSFORMERS=1``, raise otherwise."""
    version = installed_transformers()
    if Version(version) in SpecifierSet(TESTED_TRANSFORMERS) and not found:
        return
    where = f"nopad was written for transformers{TESTED_TRANSFORMERS} (tested; pinned in nopad's pyproject.toml)"
    if found:
        more = f" (and {len(found) - SHOWN} more: nopad.packing.hf.compat.problems())" if len(found) > SHOWN else ""
        raise UntestedTransformersError(
            f"{where}, and this transformers {version} differs where nopad "
            f"reaches into it: {'; '.join(found[:SHOWN])}{more}. Install "
            f"transformers{TESTED_TRANSFORMERS}"
        )
    if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        logger.warning(
            "%s; running on untested transformers %s because %s is set (the names nopad uses match)",
            where,
            version,
            ALLOW_UNTESTED_ENV,
        )
        return
    raise UntestedTransformersError(
        f"{where}; this is transformers {version}. The private names nopad uses "
        f"match, but other behaviour may have changed. Install "
        f"transformers{TESTED_TRANSFORMERS}, or set {ALLOW_UNTESTED_ENV}=1 to "
        "run on it anyway"
    )


_checked: set[Touch] = set()
_refusal: list[str] = []  # the refusal once made: every later use is refused the same way


def check() -> None:
    """Check every listed name not checked yet in this process (a set look-up after the first call;
    a lazy module's names once its user imported it) and refuse an untested or differing transformers."""
    if _refusal:
        raise UntestedTransformersError(_refusal[0])
    pending = [t for t in TOUCHED if t not in _checked and (t.module not in LAZY_MODULES or t.module in sys.modules)]
    if not pending:
        return
    try:
        refuse_untested(problems(tuple(pending)))
    except UntestedTransformersError as error:
        _refusal.append(str(error))
        raise
    _checked.update(pending)


def reset() -> None:
    """Forget what was checked (tests)."""
    _checked.clear()
    _refusal.clear()
