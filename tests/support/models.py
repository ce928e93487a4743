"""Tiny random-weight decoders of every model family nopad supports, for fast exactness tests.

``tiny_model("llama")`` builds a 2-layer fp32 model in eval mode from a fixed seed, so two calls
give identical weights. Sliding windows are short (8 tokens) so tests with sequences of a few
dozen tokens exercise them; Gemma2 alternates sliding and full layers and soft-caps logits.
"""

from __future__ import annotations

import contextlib

import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2")
# families whose layers mix tokens besides attention: recurrent state / convolution over time
HYBRID_FAMILIES = (
    "qwen3_5",
    "qwen3_next",
    "olmo_hybrid",
    "lfm2",
    "nemotron_h",
    "granitemoehybrid",
    "bamba",
    "falcon_h1",
    "jamba",
    "kimi_linear",
)
SINK_FAMILIES = ("gpt_oss",)  # attention sinks (s_aux)
# hybrid families with Mamba2 layers: exact on packed and tree rows and in the generator
# (nopad.packing.mixers.mamba2)
MAMBA2_FAMILIES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1")
# attention layouts besides one head size: Gemma4 (K/V shared across its last layers, a larger head
# on full-attention layers, per-layer inputs), DeepSeek-V3 (MLA: keys and values of different sizes),
# MiMo-V2-Flash (twice the K/V heads on its sliding layers, which its config does not say; sinks there)
LAYOUT_FAMILIES = ("gemma4", "deepseek_v3", "mimo_v2_flash")
# attention of kinds nopad does not know, declared by the config (DeepSeek-V4's compressed K/V pooled
# over windows of the row, and sinks; DeepSeek-V3.2's indexer picking each query's keys): refused
UNKNOWN_ATTENTION_FAMILIES = ("deepseek_v4", "deepseek_v32")
# positions nopad cannot set: BART's decoder counts them itself (no position_ids); Roberta's learned
# table starts past its padding index
POSITION_FAMILIES = ("bart", "roberta")
# Llama4: chunk-local attention (a mask transformers builds, which nopad's attention replaces) and an
# attention temperature from positions its NoPE layers count themselves
CHUNKED_FAMILIES = ("llama4",)

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

_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, q_lora_rank=None)
_HYBRID4 = ["linear_attention", "full_attention"] * 2  # 4 layers, each kind twice
_FAMILY.update(
    {
        "qwen3_5": (
            transformers.Qwen3_5TextConfig,
            transformers.Qwen3_5ForCausalLM,
            {"head_dim": 16, "num_hidden_layers": 4, "layer_types": _HYBRID4, **_LINEAR},
        ),
        "qwen3_next": (
            transformers.Qwen3NextConfig,
            transformers.Qwen3NextForCausalLM,
            {
                "head_dim": 16,
                "num_hidden_layers": 4,
                "layer_types": _HYBRID4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                **_LINEAR,
            },
        ),
        "olmo_hybrid": (
            transformers.OlmoHybridConfig,
            transformers.OlmoHybridForCausalLM,
            {"num_hidden_layers": 4, "layer_types": _HYBRID4},
        ),
        "lfm2": (
            transformers.Lfm2Config,
            transformers.Lfm2ForCausalLM,
            {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2},
        ),
        "nemotron_h": (
            transformers.NemotronHConfig,
            transformers.NemotronHForCausalLM,
            {
                "num_hidden_layers": 4,
                "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
                "mamba_num_heads": 4,
                "mamba_head_dim": 16,
                "ssm_state_size": 16,
                "n_groups": 1,
                "head_dim": 16,
            },
        ),
        "granitemoehybrid": (
            transformers.GraniteMoeHybridConfig,
            transformers.GraniteMoeHybridForCausalLM,
            {
                "num_hidden_layers": 4,
                "layer_types": ["mamba", "attention"] * 2,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                **_MAMBA2,
            },
        ),
        "bamba": (
            transformers.BambaConfig,
            transformers.BambaForCausalLM,
            {"num_hidden_layers": 4, "attn_layer_indices": [1, 3], **_MAMBA2},
        ),
        "falcon_h1": (
            transformers.FalconH1Config,
            transformers.FalconH1ForCausalLM,
            {"num_hidden_layers": 4, "mamba_d_ssm": 128, "head_dim": 16, **_MAMBA2},
        ),
        "jamba": (
            transformers.JambaConfig,
            transformers.JambaForCausalLM,
            {
                "num_hidden_layers": 4,
                "attn_layer_period": 2,
                "attn_layer_offset": 1,
                "expert_layer_period": 2,
                "num_experts": 2,
                "mamba_d_state": 8,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
            },
        ),
        "kimi_linear": (
            transformers.KimiLinearConfig,
            transformers.KimiLinearForCausalLM,
            {
                "num_hidden_layers": 4,
                "v_head_dim": 16,
                "num_experts": 4,
                "num_experts_per_token": 2,
                "moe_intermediate_size": 32,
                **_MLA,
                "linear_attn_config": {
                    "kda_layers": [1, 3],
                    "full_attn_layers": [2, 4],
                    "num_heads": 4,
                    "head_dim": 16,
                    "short_conv_kernel_size": 4,
                },
            },
        ),
        "gpt_oss": (
            transformers.GptOssConfig,
            transformers.GptOssForCausalLM,
            {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": SLIDING_WINDOW},
        ),
        "gemma4": (
            transformers.Gemma4TextConfig,
            transformers.Gemma4ForCausalLM,
            {
                "num_hidden_layers": 4,
                "head_dim": 16,
                "global_head_dim": 32,
                "sliding_window": SLIDING_WINDOW,
                "vocab_size_per_layer_input": 128,
                "hidden_size_per_layer_input": 8,
                "num_kv_shared_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
        ),
        "deepseek_v3": (
            transformers.DeepseekV3Config,
            transformers.DeepseekV3ForCausalLM,
            {
                "v_head_dim": 8,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 1,
                "moe_intermediate_size": 32,
                "n_group": 1,
                "topk_group": 1,
                **_MLA,
            },
        ),
        "deepseek_v4": (
            transformers.DeepseekV4Config,
            transformers.DeepseekV4ForCausalLM,
            {
                "num_hidden_layers": 3,
                "head_dim": 16,
                "q_lora_rank": 32,
                "qk_rope_head_dim": 8,
                "o_groups": 4,
                "o_lora_rank": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "index_n_heads": 2,
                "index_head_dim": 16,
                "index_topk": 8,
                "sliding_window": SLIDING_WINDOW,
                "mlp_layer_types": ["moe"] * 3,
                "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                "layer_types": ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
            },
        ),
        "bart": (
            transformers.BartConfig,
            transformers.BartForCausalLM,
            {
                "d_model": 64,
                "decoder_layers": 2,
                "encoder_layers": 1,
                "decoder_attention_heads": 4,
                "encoder_attention_heads": 4,
                "decoder_ffn_dim": 128,
                "encoder_ffn_dim": 128,
            },
        ),
        "roberta": (transformers.RobertaConfig, transformers.RobertaForCausalLM, {"is_decoder": True}),
        "diffllama": (transformers.DiffLlamaConfig, transformers.DiffLlamaForCausalLM, {}),
        "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM, {}),
        "jetmoe": (
            transformers.JetMoeConfig,
            transformers.JetMoeForCausalLM,
            {"kv_channels": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "mimo_v2_flash": (
            transformers.MiMoV2FlashConfig,
            transformers.MiMoV2FlashForCausalLM,
            {
                "num_hidden_layers": 4,
                "head_dim": 16,
                "v_head_dim": 8,
                "sliding_window": SLIDING_WINDOW,
                "n_routed_experts": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "mlp_layer_types": ["dense", "sparse"] * 2,
            },
        ),
        "llama4": (
            transformers.Llama4TextConfig,
            transformers.Llama4ForCausalLM,
            {
                "head_dim": 16,
                "intermediate_size_mlp": 128,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "attention_chunk_size": SLIDING_WINDOW,
                "num_hidden_layers": 4,
            },
        ),
        "deepseek_v32": (
            transformers.DeepseekV32Config,
            transformers.DeepseekV32ForCausalLM,
            {
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 1,
                "moe_intermediate_size": 32,
                "n_group": 1,
                "topk_group": 1,
                "num_key_value_heads": 4,
                "index_topk": 8,
                "index_head_dim": 16,
                "index_n_heads": 2,
                **_MLA,
                "q_lora_rank": 32,
                "v_head_dim": 16,
            },
        ),
    }
)


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """The config of :func:`tiny_model` (without building weights)."""
    if family not in _FAMILY:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(_FAMILY)}")
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
    ``attn_implementation="nopad"`` after :func:`nopad.packing.hf.register_nopad_attention`).
    """
    config = tiny_config(family, **overrides)
    _, model_cls, _ = _FAMILY[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float().eval()


SERVING_CASES = ("sinks", "vocab_152k", "bf16_weights", "fp32_under_bf16_autocast")


def serving_case(case: str) -> tuple[transformers.PreTrainedModel, contextlib.AbstractContextManager]:
    """A model for one of :data:`SERVING_CASES`, and the context to generate in: an attention-sink model
    (gpt-oss), a Qwen-sized 151,936-token vocabulary, bf16 weights, or fp32 weights under bf16 autocast
    (the logits a sampler gets are then bf16)."""
    model = {
        "sinks": lambda: tiny_model("gpt_oss"),
        "vocab_152k": lambda: tiny_model("qwen2", vocab_size=151_936),
        "bf16_weights": lambda: tiny_model("llama").to(torch.bfloat16),
        "fp32_under_bf16_autocast": lambda: tiny_model("llama"),
    }[case]()
    autocast = case.endswith("autocast")
    return model, torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


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
