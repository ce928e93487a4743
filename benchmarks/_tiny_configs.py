"""Tiny random-weight configs for every model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
(benchmarks/sweep_families.py).

Generic shrink: every known size attribute the config class has is forced small; per-layer kind
lists (layer_types / layers_block_type / mlp_layer_types) are rebuilt so that every kind the
default config declares appears in the tiny model. FAMILY holds the per-family fixes.
"""

from __future__ import annotations

import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 256
LAYERS = 4
WINDOW = 8

SIZES = {
    # widths
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "embedding_size": 64,
    "embed_dim": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "d_ff": 128,
    "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "feed_forward_size": 128,
    "dim_ff": 128,
    "d_inner": 128,
    "dff": 128,
    "mlp_dim": 128,
    # depth
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "num_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_layers": 2,
    "n_layers": LAYERS,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "n_heads": 4,
    "num_heads": 4,
    "attention_heads": 4,
    "head_dim": 16,
    "kv_channels": 16,
    "attention_head_dim": 16,
    "d_head": 16,
    "dim_head": 16,
    "d_kv": 16,
    "attention_head_size": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    # positions / windows
    "max_position_embeddings": 512,
    "n_positions": 512,
    "n_ctx": 512,
    "max_target_positions": 512,
    "max_source_positions": 512,
    "sliding_window": WINDOW,
    "sliding_window_size": WINDOW,
    "attention_window_size": WINDOW,
    "local_attention_window_len": WINDOW,
    "attention_chunk_size": WINDOW,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_top_k": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    # MLA
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    "o_lora_rank": 16,
    # sparse attention indexers
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    # linear attention / delta rule
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    # mamba
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_headdim": 32,
    "mamba_ngroups": 1,
    "n_mamba_heads": 4,
    "ssm_state_size": 16,
    "state_size": 16,
    "n_groups": 1,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "mamba_d_ssm": 128,
    "lru_width": 64,
    # gemma3n / gemma4 per-layer inputs
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "laurel_rank": 8,
    "num_kv_shared_layers": 2,
    # misc
    "rotary_dim": 8,
    "global_head_dim": 32,
    "ple_embed_dim": 64,
    "hc_lowrank": 16,
    "gated_norm_rank": 8,
    "router_hidden_size": 32,
    "adapter_rank": 8,
    "n_shared_experts": 1,
    "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": 512,
}
# lists rebuilt from the default's kinds (so derived lists must not be passed at their old length)
KIND_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types")
# derived lists/ints the constructor recomputes; dropped from nested sub-config dicts
DERIVED = (
    "layer_types",
    "layers_block_type",
    "mlp_layer_types",
    "no_rope_layers",
    "moe_layers",
    "hybrid_layer_ids",
    "indexer_types",
)

# per-family overrides (applied last, top level)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1)
_QWEN4_EXP_TEXT = dict(
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=2,
    ple_layer_ids=[1],
    eos_token_id=2,
    ngram_vocab_size_base=1024,
    split_ngram_parts=4,
)
FAMILY: dict[str, dict] = {
    "bamba": dict(attn_layer_indices=[1, 3], **_MAMBA2),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 2, **_MAMBA2),
    "falcon_h1": dict(mamba_d_ssm=128, head_dim=16, **_MAMBA2),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        num_experts=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2, num_dense_layers=1),
    "kimi_linear": dict(
        v_head_dim=16,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        q_lora_rank=None,
        linear_attn_config={
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    ),
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=WINDOW),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16),
    "dory": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        n_input_layers=1,
        n_recurrent_layers=2,
        n_output_layers=1,
    ),
    "hrm_text": dict(num_hidden_layers=1),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "xlm": dict(emb_dim=64),
    "dbrx": dict(attn_config={"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0}),
    "dots3_note_text": dict(head_dim=24),
    "dots3_note": dict(
        text_config=dict(head_dim=24),
        vision_config=dict(adapter_in_dim=64),
        audio_config=dict(adapter_input_size=64),
    ),
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "qwen4_exp": dict(text_config=_QWEN4_EXP_TEXT),
    "reformer": dict(
        is_decoder=True,
        axial_pos_embds_dim=[16, 48],
        axial_pos_shape=[16, 32],
        local_attn_chunk_length=8,
        lsh_attn_chunk_length=8,
        num_buckets=4,
    ),
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"] * 2),
    "zaya": dict(num_experts_per_tok=1),
}
POST = {
    "xmod": lambda m: m.set_default_language("en_XX"),
}
SKIP: dict[str, str] = {}


def kinds_cover(default_kinds: list[str], n: int) -> list[str]:
    """n layers holding every kind of ``default_kinds``: the default's own first n layers when they
    already hold every kind, else each kind once (order of first appearance), cycled to n."""
    uniq = list(dict.fromkeys(default_kinds))
    n = max(n, len(uniq))
    if set(default_kinds[:n]) == set(uniq):
        return list(default_kinds[:n])
    return [uniq[i % len(uniq)] for i in range(n)]


# fill these even when the class default is None (HF defaults that do not build)
FILL_IF_NONE = {
    "head_dim": 16,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "topk_group": 1,
    "n_group": 1,
}
# a per-layer override (per_layer_config) of these gets another value than the base, so the
# layout stays heterogeneous
ALT = {
    "head_dim": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 24,
    "global_head_dim": 32,
}
TOKEN_KEYS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "eod_token_id",
    "mask_token_id",
)


def shrink_dict(d: dict, top: bool = True) -> dict:
    """Overrides for the (sub-)config dict ``d``: every size attribute it has, kind lists rebuilt
    to cover every kind in LAYERS layers, per-layer configs remapped, token ids in range."""
    out = {}
    n_default = d.get("num_hidden_layers") or d.get("n_layer") or d.get("num_layers")
    for key, value in d.items():
        if isinstance(value, dict) and key.endswith("config") and key != "per_layer_config" and value:
            out[key] = shrink_dict(value, top=False)
            continue
        if key in SIZES:
            if value is None and key in FILL_IF_NONE:
                out[key] = FILL_IF_NONE[key]
            elif isinstance(value, int) and not isinstance(value, bool):
                out[key] = SIZES[key]
            elif (
                isinstance(value, list) and value and all(isinstance(v, int) for v in value) and len(value) == n_default
            ):
                out[key] = [SIZES[key]] * LAYERS
    heads = out.get("num_attention_heads")
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and heads is not None:
        out["num_key_value_heads"] = heads
    elif d.get("num_key_value_heads") is not None and heads is not None:
        mha = d["num_key_value_heads"] == d.get("num_attention_heads")
        out["num_key_value_heads"] = heads if mha else 2
    if "kv_lora_rank" in d and "qk_rope_head_dim" in d:  # MLA: head_dim is the rope part
        out["head_dim"] = SIZES["qk_rope_head_dim"]
    for key in TOKEN_KEYS:
        v = d.get(key)
        if isinstance(v, int) and v >= VOCAB:
            out[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(key, 3)
        elif isinstance(v, list) and any(isinstance(x, int) and x >= VOCAB for x in v):
            out[key] = 2
    n = LAYERS
    kinds = {}
    for key in KIND_LISTS:
        v = d.get(key)
        if isinstance(v, list) and v and all(isinstance(k, str) for k in v):
            kinds[key] = v
            out[key] = kinds_cover(v, LAYERS)
            n = max(n, len(out[key]))
    for key in kinds:
        if len(out[key]) < n:
            out[key] = (out[key] * n)[:n]
    if not top:  # a sub-config keeps its derived lists only if rebuilt above
        for key in DERIVED:
            if key in d and key not in out:
                out[key] = None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in out:
            out[key] = n
    plc = d.get("per_layer_config")
    if isinstance(plc, dict) and plc:
        ref = next((kinds[k] for k in ("layer_types", "layers_block_type") if k in kinds), None)
        new_kinds = out.get("layer_types") or out.get("layers_block_type")
        remapped = {}
        for k, over in plc.items():
            i = int(k)
            small = {
                a: (ALT.get(a, SIZES.get(a, b)) if isinstance(b, int) and not isinstance(b, bool) else b)
                for a, b in over.items()
            }
            if ref is not None and new_kinds is not None and i < len(ref):
                targets = [j for j, kind in enumerate(new_kinds) if kind == ref[i]]
            else:
                targets = [i] if i < n else []
            for j in targets:
                remapped.setdefault(j, small)
        out["per_layer_config"] = {f"{j:02d}": v for j, v in sorted(remapped.items())}
    return out


def build_config(model_type: str, **extra):
    cls = CONFIG_MAPPING[model_type]
    kw = shrink_dict(cls().to_dict())
    for key, value in FAMILY.get(model_type, {}).items():
        if isinstance(value, dict) and isinstance(kw.get(key), dict):
            kw[key] = {**kw[key], **value}
        else:
            kw[key] = value
    kw.update(extra)
    return cls(**kw)


def model_class(model_type: str):
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return getattr(transformers, name)


def build_model(model_type: str, seed: int = 0, **extra):
    config = build_config(model_type, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    hook = POST.get(model_type)
    if hook is not None:
        hook(model)
    return model.float().eval()


def vocab_of(model) -> int:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(text, "vocab_size", VOCAB) or VOCAB)
