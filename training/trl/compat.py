"""The TRL that nopad's integration was written against, checked when a trainer is built.

nopad overrides, calls and sets private parts of TRL's trainers, and TRL changes those between
minor releases without notice. Several such changes would not fail but train wrong: a reordered
``_tool_call_loop`` tuple puts the log-probs where the tool mask was. So every private name nopad
touches is listed here and checked against the installed TRL's signatures and source when a
trainer is constructed; a TRL outside the tested range (:data:`TESTED_TRL`, the pin in
``pyproject.toml``) is refused with what differs. ``NOPAD_ALLOW_UNTESTED_TRL=1`` runs an untested
version whose checked names all match (a warning instead of the refusal); a mismatch is always an
error.

The one record nopad hands TRL in place of a positional tuple, :class:`ToolLoopResult`, is mapped
to TRL's positions here too (:func:`as_tool_loop_return`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import os
import textwrap
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)

TESTED_TRL = ">=1.16,<1.17"  # keep equal to the pin in pyproject.toml
ALLOW_UNTESTED_ENV = "NOPAD_ALLOW_UNTESTED_TRL"
# GRPOConfig.loss_type values TRL 1.16's GRPOTrainer computes; it checks only inside the first loss
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

# GRPOTrainer methods nopad overrides (NopadGRPOTrainerMixin) or replaces (the tool episodes):
# their leading parameters, after self
GRPO_METHODS: dict[str, tuple[str, ...]] = {
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),
    "_generate": ("prompts",),
    "_compute_loss": ("model", "inputs"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "_tool_call_loop": (
        "prompts",
        "prompt_ids",
        "completion_ids",
        "completions",
        "logprobs",
        "images",
        "multimodal_fields",
    ),
}
# GRPOTrainer attributes nopad reads or sets: TRL's GRPOTrainer must assign each
GRPO_ATTRIBUTES = (
    "tools",
    "max_tool_calling_iterations",
    "chat_template",
    "chat_template_kwargs",
    "environment_factories",
    "_env_tools",
    "_batch_environments",
    "_sync_tool_dicts",
    "_async_tool_dicts",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "eos_token_ids",
    "rollout_func",
    "_metrics",
    "_entropy_bonus_enabled",
    "ref_model",
    "loss_type",
    "use_vllm",
    "vllm_mode",
    "vllm_generation",
    "_last_loaded_step",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
)
# the batch keys NopadGRPOTrainerMixin._compute_loss reads: TRL's _compute_loss must read them too
LOSS_INPUT_KEYS = ("completion_mask", "tool_mask", "sampling_per_token_logps")
SFT_ATTRIBUTES = ("completion_only_loss",)
# TRL functions nopad calls: (module, name) -> the parameters it passes
TRL_FUNCTIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("trl.chat_template_utils", "parse_response"): ("tokenizer", "ids", "prefix", "tools"),
    ("trl.models", "unwrap_model_for_generation"): (
        "model",
        "accelerator",
        "gather_deepspeed3_params",
        "gradient_checkpointing_kwargs",
    ),
}


# ----------------------------------------------------------------------------- the tool-loop record
@dataclass(frozen=True)
class ToolLoopResult:
    """What nopad's tool episodes hand TRL in place of running its ``_tool_call_loop``: one entry
    per completion in each list."""

    model_mask: list[list[int]]  # per completion token: 1 a model token (trained on), 0 a tool's
    messages: list[list[dict]]  # the completion as chat messages, what reward functions read
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # per completion token, 0.0 at tool tokens
    tool_calls: int
    tool_failures: int
    tool_images: list[list]

    def __post_init__(self):
        per_completion = (self.model_mask, self.messages, self.completion_ids, self.logprobs, self.tool_images)
        if len({len(x) for x in per_completion}) != 1:
            raise ValueError(f"ToolLoopResult lists differ in length: {[len(x) for x in per_completion]}")
        for i, (mask, ids, logps) in enumerate(zip(self.model_mask, self.completion_ids, self.logprobs)):
            if not len(mask) == len(ids) == len(logps):
                raise ValueError(
                    f"completion {i}: {len(ids)} tokens but {len(mask)} mask entries and {len(logps)} log-probs"
                )


# TRL 1.16's _tool_call_loop return, position by position (its names) -> the record's field
TOOL_LOOP_RETURN = {
    "tool_mask": "model_mask",
    "completions": "messages",
    "completion_ids": "completion_ids",
    "logprobs": "logprobs",
    "tool_call_count": "tool_calls",
    "tool_failure_count": "tool_failures",
    "tool_images": "tool_images",
}
# method -> (the TRL method that unpacks its result, names in its return, names its caller unpacks into)
RETURNS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "_tool_call_loop": ("_generate", tuple(TOOL_LOOP_RETURN), tuple(TOOL_LOOP_RETURN)),
    "_get_per_token_logps_and_entropies": (
        "_compute_loss",
        ("logps", "entropies", "aux_loss"),
        ("per_token_logps", "entropies", "aux_loss"),
    ),
}


def as_tool_loop_return(result: ToolLoopResult) -> tuple:
    """The record as the tuple TRL's ``_generate`` unpacks (positions checked by :func:`grpo_problems`)."""
    return tuple(getattr(result, field) for field in TOOL_LOOP_RETURN.values())


def hand_back_tool_loop(trainer, result: ToolLoopResult) -> None:
    """TRL calls ``trainer._tool_call_loop(...)`` on a rollout_func's completions whenever it has
    tools, to run their calls. The episodes ran every round already: the trainer's next call, once,
    returns what they recorded instead of calling the tools again."""

    def recorded(*args, **kwargs):
        del trainer._tool_call_loop  # once: the next batch hands back its own episodes
        return as_tool_loop_return(result)

    trainer._tool_call_loop = recorded


# ----------------------------------------------------------------------------- reading TRL's source
@functools.lru_cache(maxsize=256)
def function_tree(fn) -> ast.AST:
    """The parsed source of one function (cached per function object: a patched method is re-read)."""
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def _self_attributes(fn, ctx: type) -> set[str]:
    return {
        n.attr
        for n in ast.walk(function_tree(fn))
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and isinstance(n.ctx, ctx)
    }


def trl_methods(cls: type) -> dict[str, object]:
    """Every function defined by the TRL classes of ``cls``'s MRO, as ``Class.method``."""
    return {
        f"{klass.__name__}.{name}": fn
        for klass in cls.__mro__
        if klass.__module__.startswith("trl.")
        for name, fn in vars(klass).items()
        if inspect.isfunction(fn)
    }


def _return_names(fn) -> tuple[str, ...] | None:
    """The names in ``fn``'s closing ``return a, b, ...`` (None when it ends otherwise)."""
    last = function_tree(fn).body[0].body[-1]
    value = last.value if isinstance(last, ast.Return) else None
    if isinstance(value, ast.Tuple) and all(isinstance(e, ast.Name) for e in value.elts):
        return tuple(e.id for e in value.elts)
    return None


def _unpacked_names(caller, method: str) -> tuple[str, ...] | None:
    """The names ``caller`` unpacks ``self.<method>(...)`` into (None when it does not)."""
    for node in ast.walk(function_tree(caller)):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == method
            and isinstance(node.targets[0], ast.Tuple)
        ):
            return tuple(e.id if isinstance(e, ast.Name) else ast.unparse(e) for e in node.targets[0].elts)
    return None


# ----------------------------------------------------------------------------- the checks
def _leading_params(fn) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def grpo_problems(grpo: type) -> list[str]:
    """What differs, in TRL's ``GRPOTrainer`` class ``grpo``, from what nopad was written for."""
    problems = []
    for name, params in GRPO_METHODS.items():
        fn = getattr(grpo, name, None)
        if not inspect.isfunction(fn):
            problems.append(f"GRPOTrainer.{name} is gone")
        elif _leading_params(fn)[: len(params)] != params:
            problems.append(f"GRPOTrainer.{name} takes {_leading_params(fn)}, not {params}")
    if problems:
        return problems
    for name, (caller, returned, unpacked) in RETURNS.items():
        got, got_caller = _return_names(getattr(grpo, name)), _unpacked_names(getattr(grpo, caller), name)
        if got != returned:
            problems.append(
                f"GRPOTrainer.{name} returns {got or 'something other than a tuple of names'}, not {returned}"
            )
        if got_caller != unpacked:
            problems.append(f"GRPOTrainer.{caller} unpacks {name}'s result into {got_caller}, not {unpacked}")
    assigned = set().union(*(_self_attributes(fn, ast.Store) for fn in trl_methods(grpo).values()))
    problems += [f"GRPOTrainer no longer sets self.{name}" for name in GRPO_ATTRIBUTES if name not in assigned]
    keys = {n.value for n in ast.walk(function_tree(grpo._compute_loss)) if isinstance(n, ast.Constant)}
    problems += [
        f"GRPOTrainer._compute_loss no longer reads inputs[{key!r}]" for key in LOSS_INPUT_KEYS if key not in keys
    ]
    return problems + _function_problems()


def _function_problems() -> list[str]:
    problems = []
    for (module, name), params in TRL_FUNCTIONS.items():
        fn = getattr(importlib.import_module(module), name, None)
        if fn is None:
            problems.append(f"{module}.{name} is gone")
        elif not set(params) <= set(inspect.signature(fn).parameters):
            problems.append(f"{module}.{name} takes {tuple(inspect.signature(fn).parameters)}, not {params}")
    return problems


def sft_problems(sft: type) -> list[str]:
    """What differs, in TRL's ``SFTTrainer`` class ``sft``, from what nopad was written for."""
    assigned = set().union(*(_self_attributes(fn, ast.Store) for fn in trl_methods(sft).values()))
    return [f"SFTTrainer no longer sets self.{name}" for name in SFT_ATTRIBUTES if name not in assigned]


class UntestedTRLError(RuntimeError):
    """The installed TRL is outside the tested range, or differs where nopad reaches into it."""


def installed_trl() -> str:
    import trl

    return trl.__version__


def refuse_untested(problems: list[str], what: str) -> None:
    """Raise one error naming the tested range and what differs; or, for an untested version with no
    difference, warn when ``NOPAD_ALLOW_UNTESTED_TRL=1`` and raise otherwise."""
    version = installed_trl()
    tested = Version(version) in SpecifierSet(TESTED_TRL)
    if tested and not problems:
        return
    allowed = os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0")
    where = f"{what} was written for trl{TESTED_TRL} (tested; pinned in nopad's pyproject.toml)"
    if problems:
        raise UntestedTRLError(
            f"{where}, and this trl {version} differs where nopad reaches into it: "
            + "; ".join(problems)
            + f". Install trl{TESTED_TRL}"
        )
    if allowed:
        logger.warning(
            "%s; running on untested trl %s because %s is set (the names nopad uses match)",
            where,
            version,
            ALLOW_UNTESTED_ENV,
        )
        return
    raise UntestedTRLError(
        f"{where}; this is trl {version}. The private names nopad uses match, but other "
        f"behaviour may have changed. Install trl{TESTED_TRL}, or set "
        f"{ALLOW_UNTESTED_ENV}=1 to run on it anyway"
    )


def trl_base(cls: type, name: str) -> type:
    """TRL's own ``name`` class (``GRPOTrainer``, ``SFTTrainer``) among ``cls``'s bases."""
    import trl

    base = getattr(trl, name)
    if not issubclass(cls, base):
        raise TypeError(f"{cls.__name__} must subclass trl.{name}")
    return base


def check_grpo_trainer(cls: type) -> None:
    """At construction of a GRPOTrainer nopad reaches into (``NopadGRPOTrainer``, or a TRL
    ``GRPOTrainer`` given ``nopad_rollout_func``)."""
    refuse_untested(grpo_problems(trl_base(cls, "GRPOTrainer")), "nopad's GRPOTrainer integration")


def check_loss_type(args) -> None:
    """An unknown ``args.loss_type`` is refused when the trainer is built: TRL raises it only in
    the first loss computation, after the first rollout of ``train()``."""
    loss_type = getattr(args, "loss_type", None)
    if args is not None and loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(
            f"GRPOConfig.loss_type={loss_type!r} is not a loss TRL's GRPOTrainer knows; use one "
            f"of {', '.join(GRPO_LOSS_TYPES)}"
        )


def check_sft_trainer(cls: type) -> None:
    refuse_untested(sft_problems(trl_base(cls, "SFTTrainer")), "NopadSFTTrainer")
