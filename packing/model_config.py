"""The one place nopad reads a model's language-model config from.

A multimodal class (Gemma3 / Gemma4 image-text, Fuyu: what ``AutoModelForCausalLM`` returns for
Gemma's released 4B+ checkpoints) keeps its vocabulary, layer count and layer kinds on a nested
``text_config``; reading them off the top-level config crashed the generator (found by
benchmarks/sweep_families.py)."""

from __future__ import annotations


def text_config(config):
    """The language model's config (a multimodal model's ``text_config``; the config itself else)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
