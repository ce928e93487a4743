"""Models for the recipes: ``model.path`` to ``(model, tokenizer)`` (the embedded SmolLM2, a tiny
test model, a local Hugging Face directory, a training run's newest checkpoint, or a LoRA adapter on
the base it records), and back to a directory the next recipe loads. The config sections that name
them (:class:`nopad.recipes.config_sections.ModelConfig`, :class:`nopad.recipes.config_sections.LoRAConfig`)
stay with the configs."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from nopad.recipes.config import ConfigError, LoRAConfig, ModelConfig

logger = logging.getLogger(__name__)


def load_model(model_cfg: ModelConfig):
    """``(model, tokenizer)`` for ``model.path``: ``"smollm2"`` is the embedded SmolLM2-135M-Instruct
    (offline), ``"tiny:llama"`` a tiny random-weight Llama with an ASCII tokenizer (smoke runs);
    anything else is a local Hugging Face model directory, or a LoRA adapter directory (loaded onto
    the base it records). With ``model.lora`` set the model comes back as a peft ``PeftModel`` whose
    adapter alone trains; without it an adapter is merged into its base (a plain model)."""
    from nopad.training import lora as peft_lora

    lora: LoRAConfig | None = getattr(model_cfg, "lora", None)
    path = check_model_path(model_cfg.path)
    if peft_lora.is_adapter_dir(path):
        model, tokenizer = _load_adapter_dir(model_cfg, path, lora)
        return model, _with_tool_template(tokenizer, model_cfg.tool_template)
    model, tokenizer = _load_base(model_cfg, path)
    if lora is not None:
        base = path if path == "smollm2" or path.startswith("tiny:") else str(Path(path).resolve())
        model = peft_lora.apply_lora(
            model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.targets, base=base
        )
    return model, _with_tool_template(tokenizer, model_cfg.tool_template)


def _with_tool_template(tokenizer, template: str | None):
    """``model.tool_template``: the tokenizer with a chat template that writes tool calls."""
    from nopad.inference.tools import use_tool_template

    if template is None:
        return tokenizer
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ConfigError(
            "model.tool_template",
            f"needs a tokenizer with chat templates; this model's is "
            f"{type(tokenizer).__name__} (tiny:* models have a plain ASCII tokenizer)",
        )
    try:
        return use_tool_template(tokenizer, template)
    except ValueError as err:
        raise ConfigError("model.tool_template", f"cannot be used: {err}") from None


def _load_adapter_dir(model_cfg: ModelConfig, path: str, lora: LoRAConfig | None):
    """A LoRA adapter directory on its recorded base: trained further when ``model.lora`` is set
    (with the adapter's own settings: others are an error, not a silent choice), else merged."""
    from nopad.training import lora as peft_lora

    base = peft_lora.adapter_base(path)
    if not (base == "smollm2" or base.startswith("tiny:") or Path(base).is_dir()):
        raise FileNotFoundError(
            f"model.path={path} is a LoRA adapter for the base model {base!r}, which is not here ({path}/"
            f"{peft_lora.ADAPTER_CONFIG} records it as {peft_lora.BASE_KEY}); put the base model there, or "
            f"set {peft_lora.BASE_KEY} to the base model's local directory"
        )
    if lora is not None:
        differ = lora_differences(path, lora)
        if differ:
            raise ConfigError(
                "model.lora",
                f"does not match the adapter in model.path={path}: "
                f"{'; '.join(differ)}. Training continues that adapter: set model.lora to its "
                "settings, or model.lora=null to fine-tune the merged model in full",
            )
    logger.info("model.path=%s is a LoRA adapter on %s", path, base)
    base_cfg = dataclasses.replace(model_cfg, path=base)
    if hasattr(base_cfg, "lora"):
        base_cfg.lora = None
    model, tokenizer = _load_base(base_cfg, check_model_path(base))
    model = peft_lora.load_adapter(model, path, trainable=lora is not None)
    return model, _saved_tokenizer(path) or tokenizer


def lora_differences(adapter_dir: str | Path, lora: LoRAConfig) -> list[str]:
    """``model.lora.<key>=<value> but the adapter has <saved>`` for each LoRA setting that differs
    from the adapter saved in ``adapter_dir``; empty when they match."""
    from nopad.training import lora as peft_lora

    saved = peft_lora.adapter_settings(adapter_dir)
    wanted = {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "target_modules": lora.targets if isinstance(lora.targets, str) else sorted(lora.targets),
    }
    if saved["target_modules"] != "all-linear" and wanted["target_modules"] == "all-linear":
        wanted["target_modules"] = saved["target_modules"]  # peft saves all-linear as the names it found
    return [f"model.lora.{k}={wanted[k]!r} but the adapter has {saved[k]!r}" for k in wanted if saved[k] != wanted[k]]


def check_resume_lora(checkpoint_dir: str | Path, lora: LoRAConfig | None) -> None:
    """Resuming needs the LoRA settings of the run that wrote ``checkpoint_dir``: a changed one is
    an error naming it (before loading, which would fail on shapes, or, for ``alpha`` or
    ``dropout``, go on silently with another model)."""
    from nopad.training import lora as peft_lora

    if not Path(checkpoint_dir).is_dir():
        return  # the resume itself says what is missing
    adapter = peft_lora.is_adapter_dir(checkpoint_dir)
    if lora is None and adapter:
        settings = ", ".join(f"{k}={v}" for k, v in peft_lora.adapter_settings(checkpoint_dir).items())
        raise ConfigError(
            "model.lora",
            f"is null, but checkpoint {checkpoint_dir} holds a LoRA adapter "
            f"({settings}); resume with that run's model.lora settings",
        )
    if lora is not None and not adapter:
        raise ConfigError(
            "model.lora",
            f"is set, but checkpoint {checkpoint_dir} holds a full fine-tune; resume it with model.lora=null",
        )
    differ = lora_differences(checkpoint_dir, lora) if lora is not None else []
    if differ:
        raise ConfigError(
            "model.lora",
            f"changed since checkpoint {checkpoint_dir} was written: "
            f"{'; '.join(differ)}. Resume with the settings of the run that wrote it, or "
            "start a fresh run in another checkpoint.output_dir",
        )


def _saved_tokenizer(path: str):
    """The tokenizer saved in a model or adapter directory, or None if it holds none."""
    from transformers import AutoTokenizer

    from nopad.recipes.tiny_model import AsciiTokenizer

    if (Path(path) / AsciiTokenizer.SAVED_NAME).is_file():  # a checkpoint of a tiny:* model
        return AsciiTokenizer.from_pretrained(path)
    if (Path(path) / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(path)
    return None


def _load_base(model_cfg: ModelConfig, path: str):
    """``(model, tokenizer)`` of a model that is not an adapter (``path`` already checked)."""
    import torch

    dtype = getattr(torch, model_cfg.dtype)
    if path.startswith("tiny:"):  # smoke runs and multi-process tests: no files, ASCII tokens
        from nopad.recipes.tiny_model import AsciiTokenizer, tiny_causal_lm

        model, _ = tiny_causal_lm(path.split(":", 1)[1])
        return model.to(dtype).eval(), AsciiTokenizer()
    if path == "smollm2":
        from nopad.assets.smollm2 import load_smollm2

        return load_smollm2(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as err:  # a truncated or damaged weights file, mostly (safetensors has its own type)
        files = sorted(p.name for p in Path(path).iterdir())
        weights = ", ".join(n for n in files if n.endswith((".safetensors", ".bin")))
        raise RuntimeError(
            f"model.path={path}: could not load the model from {weights or 'its files'}"
            f" ({type(err).__name__}: {err}); the file may be truncated (a run stopped while "
            "writing it, or a copy that did not finish): use another checkpoint"
        ) from err
    check_tokenizer_files(path)
    return model.eval(), _saved_tokenizer(path) or AutoTokenizer.from_pretrained(path)


# a tokenizer's vocabulary, in the files transformers reads it from (fast, SentencePiece, BPE, WordPiece,
# tiktoken); tokenizer_config.json alone holds none, and transformers then asks for sentencepiece
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def check_tokenizer_files(path: str | Path) -> None:
    """A model directory must hold its tokenizer: without one, transformers ends in "install
    sentencepiece or tiktoken", which is not the cause."""
    from nopad.recipes.tiny_model import AsciiTokenizer

    path = Path(path)
    if (path / AsciiTokenizer.SAVED_NAME).is_file():  # a checkpoint of a tiny:* model
        return
    if any(p.is_file() for pattern in TOKENIZER_FILES for p in path.glob(pattern)):
        return
    alone = (path / "tokenizer_config.json").is_file()
    raise FileNotFoundError(
        f"model.path={path} holds no tokenizer files"
        f"{' (tokenizer_config.json alone holds no vocabulary)' if alone else ''}: looked for "
        f"{', '.join(TOKENIZER_FILES)}; copy the tokenizer files of the model it came from into it (or "
        "write them there with tokenizer.save_pretrained)"
    )


def save_model_dir(accelerator, model, tokenizer, path: str | Path) -> None:
    """Write an HF model directory (config, safetensors weights, tokenizer) that
    ``AutoModelForCausalLM.from_pretrained``, ``nopad.recipes.evaluate`` and ``nopad.recipes.grpo`` load. The
    weights are consolidated by Accelerate (DDP, DeepSpeed ZeRO, FSDP); every rank must call this.
    A LoRA model writes its adapter alone (``adapter_model.safetensors``, ``adapter_config.json``
    naming the base model), which ``model.path`` loads onto that base."""
    from nopad.training.lora import is_peft_model

    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        use_cache = unwrapped.config.use_cache
        unwrapped.config.use_cache = True  # training turns the KV cache off; a loaded model wants it
        extra = {"save_embedding_layers": False} if is_peft_model(unwrapped) else {}  # no Hub look-up
        unwrapped.save_pretrained(str(path), state_dict=state, safe_serialization=True, **extra)
        unwrapped.config.use_cache = use_cache
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(path))
    accelerator.wait_for_everyone()


def check_model_path(path) -> str:
    """``model.path`` must be ``"smollm2"``, ``"tiny:<family>"`` or an existing model directory."""
    if not path:
        raise ValueError(
            "model.path is missing: set model.path=smollm2 (the embedded demo model) "
            "or a local Hugging Face model directory"
        )
    path = str(path)
    if path == "smollm2" or path.startswith("tiny:"):
        return path
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"model.path={path!r} is not a directory; give a local Hugging Face "
            "model directory, a training run's output directory, or model.path=smollm2"
        )
    from nopad.training.checkpoint import resolve_model_dir

    return str(resolve_model_dir(path))
