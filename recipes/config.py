"""Recipe configs: YAML data plus ``key=value`` overrides, checked against the recipe's defaults.

A recipe's default YAML file lists every key it understands, so a typo (``rollout.max_token=8``)
is an error naming the key instead of a silently ignored setting.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping at the top level")
    return data


def _merge(base: dict, update: Mapping, prefix: str = "") -> None:
    for key, value in update.items():
        name = f"{prefix}{key}"
        if key not in base:
            raise KeyError(f"unknown config key {name!r}; known keys here: {sorted(base)}")
        if isinstance(base[key], dict):
            if not isinstance(value, Mapping):
                raise ValueError(f"config key {name!r} is a section; set its fields as {name}.<field>=...")
            _merge(base[key], value, prefix=f"{name}.")
        else:
            base[key] = _checked(name, base[key], value)


def _checked(name: str, default, value):
    """``value`` for a key whose default is ``default``: a number stays a number and a flag a flag,
    so ``train.lr=abc`` is an error naming the key, not a TypeError deep inside the optimizer."""
    if value is None or default is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    elif isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if isinstance(default, float):
            return float(value)
    return value


def parse_override(text: str) -> dict:
    """``"a.b=3"`` -> ``{"a": {"b": 3}}``; the value is parsed as YAML (numbers, null, true)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value")
    dotted, _, raw = text.partition("=")
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str):
        try:  # YAML 1.1 reads "1e-5" as a string
            value = float(value)
        except ValueError:
            pass
    out: dict = value
    for part in reversed(dotted.strip().split(".")):
        out = {part: out}
    return out


def load_config(defaults: str | Path, path: str | Path | None = None,
                overrides: Sequence[str] | Mapping = ()) -> dict:
    """The defaults file, updated by the user's file (if any) and then by the overrides
    (``["train.steps=3"]`` or a nested dict)."""
    cfg = _read_yaml(defaults)
    if path is not None and Path(path).resolve() != Path(defaults).resolve():
        _merge(cfg, _read_yaml(path))
    return update_config(cfg, overrides)


def update_config(cfg: dict, overrides: Sequence[str] | Mapping) -> dict:
    """Apply ``["section.key=value", ...]`` or a nested dict to ``cfg`` in place (and return it);
    unknown keys are errors."""
    if isinstance(overrides, Mapping):
        _merge(cfg, copy.deepcopy(dict(overrides)))
    else:
        for text in overrides:
            _merge(cfg, parse_override(text))
    return cfg


def require(cfg: Mapping, section: str, key: str, minimum: int) -> None:
    """An integer setting ``section.key`` that must be at least ``minimum``."""
    value = cfg[section][key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{section}.{key} must be an integer >= {minimum}, got {value!r}")


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def load_model(model_cfg: Mapping):
    """``(model, tokenizer)`` for ``model.path``: ``"smollm2"`` is the embedded SmolLM2-135M-Instruct
    (offline), ``"tiny:llama"`` a tiny random-weight Llama with an ASCII tokenizer (smoke runs);
    anything else is a local Hugging Face model directory."""
    import torch

    name = str(model_cfg.get("dtype", "float32"))
    if name not in MODEL_DTYPES:
        raise ValueError(f"model.dtype={model_cfg.get('dtype')!r} is not a dtype the recipes train or "
                         f"generate in; choose one of {', '.join(MODEL_DTYPES)}")
    dtype = getattr(torch, name)
    path = check_model_path(model_cfg.get("path"))
    if path.startswith("tiny:"):  # smoke runs and multi-process tests: no files, ASCII tokens
        from recipes.tasks import AsciiTokenizer, tiny_causal_lm

        model, _ = tiny_causal_lm(path.split(":", 1)[1])
        return model.eval(), AsciiTokenizer()
    if path == "smollm2":
        from assets.smollm2 import load_smollm2

        return load_smollm2(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.tasks import AsciiTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if (Path(path) / AsciiTokenizer.SAVED_NAME).is_file():  # a checkpoint of a tiny:* model
        return model.eval(), AsciiTokenizer.from_pretrained(path)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def save_model_dir(accelerator, model, tokenizer, path: str | Path) -> None:
    """Write an HF model directory (config, safetensors weights, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained``, ``recipes.evaluate`` and ``recipes.grpo`` load. The
    weights are consolidated by Accelerate (DDP, DeepSpeed ZeRO, FSDP); every rank must call this."""
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        use_cache = unwrapped.config.use_cache
        unwrapped.config.use_cache = True  # training turns the KV cache off; a loaded model wants it
        unwrapped.save_pretrained(str(path), state_dict=state, safe_serialization=True)
        unwrapped.config.use_cache = use_cache
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(path))
    accelerator.wait_for_everyone()


def check_model_path(path) -> str:
    """``model.path`` must be ``"smollm2"``, ``"tiny:<family>"`` or an existing model directory."""
    if not path:
        raise ValueError("model.path is missing: set model.path=smollm2 (the embedded demo model) "
                         "or a local Hugging Face model directory")
    path = str(path)
    if path == "smollm2" or path.startswith("tiny:"):
        return path
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.path={path!r} is not a directory; give a local Hugging Face "
                                "model directory, a training run's output directory, or model.path=smollm2")
    from training.checkpoint import resolve_model_dir

    return str(resolve_model_dir(path))
