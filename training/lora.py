"""LoRA through peft, as the recipes run it: wrap a model in an adapter, load a saved adapter onto
its base, and keep a checkpoint's resume state to the adapter.

Why here and not in every recipe: an adapter run differs from a full fine-tune in three places
only (which parameters train, what a checkpoint holds, how a saved directory becomes a model), and
each has a pitfall that is silent otherwise: Accelerate's ``save_state`` writes the whole frozen
base beside every adapter checkpoint, and a resume that loads an adapter-only state dict without
``strict`` checks would accept one written for other target modules without a word.

The trained model is peft's ``PeftModel``; the generator and the training forward run it as any
other model (its LoRA layers are ``nn.Linear``, so :func:`nopad.packing.batch_invariant` covers them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside the adapter weights
BASE_KEY = "base_model_name_or_path"  # the adapter config's record of its base model


def is_peft_model(model) -> bool:
    """Whether ``model`` (unwrapped) is a peft ``PeftModel`` (an adapter on a frozen base)."""
    return any(cls.__name__ == "PeftModel" for cls in type(model).__mro__)


def is_adapter_dir(path: str | Path) -> bool:
    """A directory written by ``PeftModel.save_pretrained`` (an adapter, not a whole model)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _peft():
    """peft, or an error that says how to get it (it is an optional dependency of nopad)."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "LoRA (model.lora, or a LoRA adapter as model.path) runs through peft, which is "
            "not installed: pip install 'peft>=0.13'"
        ) from err
    return peft


def apply_lora(model, *, rank: int, alpha: float, dropout: float, target_modules: str | list[str], base: str):
    """``model`` wrapped in a fresh LoRA adapter (only the adapter trains); ``base`` is how to load
    the base model again (a model directory, ``smollm2``, ``tiny:llama``), recorded in the adapter's
    config so that an adapter directory alone names what it applies to."""
    peft = _peft()
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    modules = [n for n, _ in model.named_modules()]
    # peft adapts the names it finds and skips the rest: a typo would train fewer layers unsaid
    missing = (
        []
        if isinstance(target_modules, str)
        else [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in modules)]
    )
    if missing:
        raise ValueError(
            f"model.lora.target_modules: {', '.join(missing)} not found in the model; its "
            f"linear layers are {', '.join(linear)} (or use all-linear)"
        )
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    peft_model = peft.get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = base
    trained, total = peft_model.get_nb_trainable_parameters()
    logger.info(
        "LoRA rank %d on %s: %d of %d parameters train (%.2f%%)",
        rank,
        target_modules,
        trained,
        total,
        100 * trained / total,
    )
    return peft_model


def adapter_base(path: str | Path) -> str:
    """The base model an adapter directory was trained on (its config's ``base_model_name_or_path``)."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get(BASE_KEY)
    if not base:
        raise ValueError(
            f"model.path={path} is a LoRA adapter whose {ADAPTER_CONFIG} names no base model "
            f"({BASE_KEY}); set it there to the base model's directory"
        )
    return str(base)


def adapter_settings(path: str | Path) -> dict:
    """An adapter directory's rank, alpha, dropout and target modules, as ``model.lora`` names them."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    targets = config.get("target_modules")
    return {
        "rank": config.get("r"),
        "alpha": config.get("lora_alpha"),
        "dropout": config.get("lora_dropout"),
        "target_modules": sorted(targets) if isinstance(targets, list) else targets,
    }


def load_adapter(base_model, path: str | Path, *, trainable: bool):
    """The adapter saved in ``path`` on ``base_model``: a ``PeftModel`` whose adapter trains further
    (``trainable``), or, for inference and full fine-tuning, the adapter merged into the base (a
    plain model, no LoRA layers left)."""
    model = _peft().PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)
    if trainable:
        return model
    return model.merge_and_unload().requires_grad_(True)  # peft froze the base: a plain model trains whole


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates (all of a full fine-tune; the adapter's under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- resume state
def keep_resume_state_to_adapter(accelerator) -> tuple[dict, dict]:
    """Make ``accelerator.save_state`` / ``load_state`` hold only the trainable parameters of its
    models (call once, after ``prepare``): the frozen base is loaded from ``model.path`` anyway, and
    written with each checkpoint it would be a full model copy per step. Loading checks that the
    state's parameters are exactly the model's trainable ones (the error names the difference).

    Returns ``(save_state kwargs, load_state kwargs)`` for the caller to pass: DeepSpeed writes its
    own checkpoint (ZeRO-3 stores each rank's shard of the frozen base too), and these leave the
    frozen parameters out of it and do not ask for them back."""
    accelerator.register_save_state_pre_hook(_save_trainable_only)
    accelerator.register_load_state_pre_hook(_load_trainable_only)
    if accelerator.state.deepspeed_plugin is None:
        return {}, {}
    return {"exclude_frozen_parameters": True}, {"load_module_strict": False}


def _trainable_names(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _save_trainable_only(models, weights, output_dir) -> None:
    for i, (model, state) in enumerate(zip(models, weights)):
        keep = _trainable_names(model)
        weights[i] = {k: v for k, v in state.items() if k in keep}


def _load_trainable_only(models, input_dir) -> None:
    """Load each model's trainable parameters ourselves, then take it off Accelerate's list (which
    would load the adapter-only file with ``strict`` and fail on the missing base)."""
    from safetensors.torch import load_file

    for i, model in enumerate(list(models)):
        name = "model" if i == 0 else f"model_{i}"
        file = Path(input_dir) / f"{name}.safetensors"
        state = (
            load_file(str(file)) if file.is_file() else torch.load(Path(input_dir) / f"{name}.bin", weights_only=True)
        )
        keep = _trainable_names(model)
        missing, unexpected = sorted(keep - set(state)), sorted(set(state) - keep)
        if missing or unexpected:
            raise RuntimeError(
                f"Missing key(s) {missing[:4]} / Unexpected key(s) {unexpected[:4]}: the "
                "checkpoint's trained parameters are not this model's (another model.path, or "
                "other model.lora settings)"
            )
        model.load_state_dict(state, strict=False)
    models.clear()
