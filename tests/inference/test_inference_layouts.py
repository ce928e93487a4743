"""The attention layouts of current families, exact in packed rows, tree rows
and the generator: Gemma4 (K/V shared across its last layers, a larger head on its full-attention
layers, per-layer inputs), DeepSeek-V3's MLA (keys of 24, values of 8 per head) and gpt-oss's
attention sinks (tests/packing/test_packing_sinks.py has the backends)."""

from __future__ import annotations

import pytest
import torch

from nopad import packing
from nopad.inference import Generator, SamplingParams
from nopad.inference.kv_cache import KVCache, LayerKV, bytes_per_block, kv_layout
from nopad.packing.attention import varlen_attention
from nopad.packing.varlen import VarlenMeta
from tests.inference.test_inference_generator import hf_greedy, prompts_of
from tests.packing.test_packing_sinks import strong_sinks
from tests.support.models import LAYOUT_FAMILIES, SINK_FAMILIES, random_sequences, tiny_config, tiny_model


@pytest.fixture(scope="module", params=LAYOUT_FAMILIES + SINK_FAMILIES)
def model(request):
    model = tiny_model(request.param)
    return strong_sinks(model) if request.param in SINK_FAMILIES else model


def test_verify_flat_and_tree(model):
    seqs = random_sequences((5, 9, 12, 20))  # past the sliding window (8) of Gemma4 and gpt-oss
    for tree in (False, True):
        report = packing.verify(model, seqs, tree=tree)
        assert report.ok(), report


@pytest.mark.parametrize("chunk,static", [(1000, False), (3, False), (1000, True)])
def test_greedy_equals_hf_generate_with_n_samples(model, chunk, static, one_thread):
    prompts = prompts_of([1, 5, 17, 9])
    gen = Generator(model, block_size=4, max_num_batched_tokens=chunk, num_blocks=64, static_decode=static)
    outs = gen.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, n=2), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(model, prompt, 10)
        assert [c.token_ids for c in out.outputs] == [ref, ref]
    assert gen.allocator.num_free == gen.allocator.num_blocks


def test_gemma4_cache_holds_only_the_layers_that_compute_kv():
    config = tiny_config("gemma4")  # layers: sliding, full, sliding (reuses 0), full (reuses 1)
    assert kv_layout(config) == [LayerKV(0, 2, 16), LayerKV(1, 2, 32), LayerKV(0, 2, 16), LayerKV(1, 2, 32)]
    cache = KVCache(kv_layout(config), num_blocks=3, block_size=4, dtype=torch.float32, device="cpu")
    assert len(cache) == 4 and len(cache.k) == 2
    assert cache[2][0] is cache[0][0] and cache[3][1] is cache[1][1]
    assert cache[1][0].shape == (3, 4, 2, 32)
    per_block = bytes_per_block(kv_layout(config), 4, torch.float32)
    assert per_block == cache.nbytes // 3 == 2 * 4 * 2 * (16 + 32) * 4


def test_mla_cache_holds_values_at_the_key_size():
    config = tiny_config("deepseek_v3")  # 4 heads, keys 16 + 8, values 8
    assert kv_layout(config) == [LayerKV(0, 4, 24), LayerKV(1, 4, 24)]


def test_a_layers_heads_come_from_its_attention_module_where_the_config_does_not_say():
    """MiMo-V2-Flash's sliding layers compute twice the K/V heads of its config's count (the family
    sweep: refused at the first step, the cache sized from the config); keys 16, values 8 per head."""
    model = tiny_model("mimo_v2_flash")
    assert kv_layout(model.config) == [LayerKV(i, 2, 16) for i in range(4)]
    assert kv_layout(model.config, model) == [
        LayerKV(0, 4, 16),
        LayerKV(1, 2, 16),
        LayerKV(2, 4, 16),
        LayerKV(3, 2, 16),
    ]


def test_keys_and_values_of_different_sizes_are_exact_on_every_cpu_backend():
    meta = VarlenMeta.from_lengths([3, 11])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(14, 4, 24, generator=g), torch.randn(14, 2, 24, generator=g)
    v = torch.randn(14, 2, 8, generator=g)
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
            for s in (slice(0, 3), slice(3, 14))
        ]
    )
    for backend in ("sdpa_loop", "sdpa_padded", "per_token", "kernel"):
        out = varlen_attention(q, k, v, meta, backend=backend)
        assert out.shape == (14, 4, 8) and (out - ref).abs().max() < 2e-6, backend


def test_a_cache_of_another_layout_is_refused_by_name():
    meta = VarlenMeta.for_step([2], [0], block_table=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.arange(2))
    cache = (torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16))
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match=r"paged cache holds \(2, 16\).*kv_layout"):
        varlen_attention(q, k, v, meta, kv_cache=cache)


def gemma3_image_text():
    """A tiny Gemma3 image-text model: a text config and a vision config under the top one, and a
    vision sub-model among its modules."""
    import transformers

    text = tiny_config("gemma2").to_dict()
    text = {
        k: text[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
        )
    }
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16
    )
    config = transformers.Gemma3Config(
        text_config={**text, "head_dim": 16, "sliding_window": 8}, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config).eval()


def test_a_multimodal_model_generates_text_as_hf_does():
    """``AutoModelForCausalLM`` gives Gemma3's (and Gemma4's) image-text class for the released
    4B+ checkpoints; its config keeps the vocabulary and positions in ``text_config``, and the
    Generator read them off the top config and crashed (found by the sweep of every causal LM
    class). Text prompts through it equal HF ``generate``."""
    model = gemma3_image_text()
    prompts = prompts_of([5, 17])
    gen = Generator(model, block_size=4, num_blocks=32)
    outs = gen.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 6) for p in prompts]


def test_bare_steps_switch_every_config_and_walk_the_modules_once(monkeypatch):
    """A bare ``step()`` switches the model to nopad attention and back (the caller's code runs
    between steps); ``set_attn_implementation`` walks every module, so only the first switch each
    way runs it, and later steps set what it set: every config (top, text, vision) nopad during
    the forward and as it was between steps."""
    import functools

    import transformers

    from nopad.inference.live_model import attention_configs

    model = gemma3_image_text()
    configs = attention_configs(model)
    before = [c._attn_implementation for c in configs]
    assert len(configs) == 3 and "nopad" not in before
    switches, during = [], []
    real = transformers.PreTrainedModel.set_attn_implementation

    @functools.wraps(real)  # its signature: nopad's transformers check reads it
    def counted(self, attn_implementation, **kwargs):
        switches.append(attn_implementation)
        return real(self, attn_implementation, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "set_attn_implementation", counted)
    model.register_forward_pre_hook(lambda *_: during.append([c._attn_implementation for c in configs]))
    gen = Generator(model, block_size=4, num_blocks=32)
    gen.add_request(prompts_of([5])[0], SamplingParams(max_tokens=4, temperature=0.0))
    del switches[:]  # the construction's own checks (a probe forward) switch too
    while gen.has_unfinished():
        gen.step()
        assert [c._attn_implementation for c in configs] == before
    assert len(during) > 3 and all(now == ["nopad"] * 3 for now in during)
    assert switches == ["nopad", before[0]]


def test_a_layer_that_calls_attention_twice_per_step_is_refused_in_the_generator_only():
    """DiffLlama's differential attention calls the attention interface twice per layer, the same
    keys with two halves of the values. A packed row is exact (each call gets its K/V); in the
    generator the second call overwrote the first's values in the layer's paged K/V and every later
    step read them back for both calls: tokens unlike HF's, with no error (the family sweep)."""
    from nopad.packing.mixers import UnsupportedMixerError

    model = tiny_model("diffllama")
    assert packing.verify(model, random_sequences((5, 9, 12))).ok()
    gen = Generator(model, block_size=4, num_blocks=32)
    with pytest.raises(UnsupportedMixerError, match=r"DiffLlamaAttention \(layer 0\) calls the attention"):
        gen.generate(prompts_of([5, 9]), SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)


def test_layers_that_drop_the_attention_kwargs_are_flat_only_and_say_why():
    """StableLM's (and Nemotron's) decoder layer calls its attention without the forward's keyword
    arguments, so ``nopad_meta`` never reaches attention. A flat row is exact (boundaries from
    position_ids); a tree row and a generator step are refused, and the error says what was dropped,
    not only that the positions are not a flat row (the family sweep)."""
    from tests.packing.test_packing_hybrid import tree_sequences

    model = tiny_model("stablelm")
    assert packing.verify(model, random_sequences((5, 9, 12))).ok()
    dropped = r"StableLmAttention got no nopad_meta.*drop the attention keyword arguments"
    with pytest.raises(ValueError, match=dropped):
        packing.verify(model, tree_sequences(2), tree=True)
    gen = Generator(model, block_size=4, num_blocks=32)
    with pytest.raises(ValueError, match=dropped):
        gen.generate(prompts_of([5, 9]), SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)


def test_kv_reshaped_at_run_time_is_refused_at_the_first_step():
    """JetMoE's attention repeats its K/V heads ``top_k`` times inside its forward, which neither its
    config nor its modules say: the cache cannot be laid out ahead, and the first step says so."""
    model = tiny_model("jetmoe")
    assert packing.verify(model, random_sequences((5, 9, 12))).ok()
    gen = Generator(model, block_size=4, num_blocks=32)
    with pytest.raises(ValueError, match="cannot be laid out ahead"):
        gen.generate(prompts_of([5, 9]), SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
