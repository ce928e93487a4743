"""Tiny random-weight decoders of every model family nopad supports, for fast exactness tests.

``tiny_model("llama")`` builds a 2-layer fp32 model in eval mode from a fixed seed, so two calls
give identical weights. Sliding windows are short (8 tokens) so tests with sequences of a few
dozen tokens exercise them; Gemma2 alternates sliding and full layers and soft-caps logits.
"""

from __future__ import annotations

import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2")

SLIDING_WINDOW = 8

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_FAMILY = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": SLIDING_WINDOW, "head_dim": 16},
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "sliding_window": SLIDING_WINDOW,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
}


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """The config of :func:`tiny_model` (without building weights)."""
    if family not in _FAMILY:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    config_cls, _, extra = _FAMILY[family]
    kwargs = {**_COMMON, **extra, **overrides}
    attn = kwargs.pop("attn_implementation", None)
    config = config_cls(**kwargs)
    if attn is not None:  # else the family's default (sdpa; eager for Gemma2, which soft-caps)
        config._attn_implementation = attn
    return config


def tiny_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny fp32 causal LM of ``family`` in eval mode, weights drawn from ``seed``.

    ``overrides`` go to the config (e.g. ``num_hidden_layers=4``,
    ``attn_implementation="nopad"`` after :func:`packing.hf.register_nopad_attention`).
    """
    config = tiny_config(family, **overrides)
    _, model_cls, _ = _FAMILY[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float().eval()


def random_sequences(lengths, seed=0):
    """Token-id tensors of the given lengths (ids 3..127, clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in lengths]


class IdText:
    """A completion's token ids as text, for rewards in GRPO steps that need no real tokenizer."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def checksum_reward(text: str, example: dict) -> float:
    """A reward of :class:`IdText` completions that varies between random completions, so the
    group advantages are non-zero."""
    return float(sum(map(int, text.split())) % 5)
