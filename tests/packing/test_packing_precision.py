"""Where users train: bf16, fp16 and fp32 weights under bf16 autocast, with the attention backend
forced to flash-attn - proven on CPU through the public entry points against a strict flash-attn
stand-in (tests/support/flash_standin.py), and the backend rule, feature detection and failure modes.

"The device" on CPU: the stand-in rejects any tensor not on q's device, and the flash-path runs
happen with VarlenMeta's default device poisoned to ``meta``. On a GPU a VarlenMeta the core
builds without naming the query's device lands on the CPU; here it lands on ``meta``, so the same
bug fails these tests. (Poisoning torch's own default device too is not possible: transformers'
mask code then calls ``.item()`` on meta tensors.)

Tolerances are the dtype's rounding, measured: the flash path (fp32 maths in the stand-in) and the
CPU path (SDPA in the compute dtype) differ only in where they round.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import pytest
import torch

from nopad.packing import attention, verify
from nopad.packing.attention import BACKEND_ENV, choose_backend, flash
from nopad.packing.hf import use_nopad_attention
from nopad.packing.hf.attention import nopad_attention
from nopad.packing.varlen import VarlenMeta
from tests.support.flash_standin import FlashStandIn, broken_package
from tests.support.models import random_sequences, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("llama", "qwen2", "mistral", "gemma2")
PRECISIONS = ("bf16", "fp16", "autocast")  # autocast: fp32 weights under torch.autocast(bf16)
# max |flash - cpu| difference allowed: logits relative to max(1, |logit|), gradients relative to
# each parameter's max |g|. Measured over the 4 families (this file's rows): flash
# vs CPU path logits bf16 6.4e-3, fp16 7.3e-4, autocast 2.9e-3 - the same size as the CPU path vs
# fp32 (7.0e-3, 9.3e-4, 6.0e-3), i.e. rounding; grads 2.5e-2, 1.2e-2, 1.1e-2. Limits are ~3x
# that; attention leaking across sequences moves logits by 1e-1 and more.
LOGIT_TOL = {"bf16": 2e-2, "fp16": 2.5e-3, "autocast": 1e-2}
GRAD_TOL = {"bf16": 8e-2, "fp16": 4e-2, "autocast": 4e-2}
COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "autocast": torch.bfloat16}


@pytest.fixture
def flash_standin(monkeypatch):
    """``install(version)`` puts a stand-in flash-attn on ``sys.modules`` (and nothing else)."""

    def install(version: str = "2.6") -> FlashStandIn:
        standin = FlashStandIn(version)
        for name in ("flash_attn", "flash_attn_interface"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setitem(sys.modules, standin.module.__name__, standin.module)
        flash.flash_attn_info.cache_clear()
        attention.registry._said.clear()
        return standin

    yield install
    flash.flash_attn_info.cache_clear()
    attention.registry._said.clear()


@pytest.fixture
def forced_flash(monkeypatch, flash_standin):
    """flash-attn 2.6 stand-in installed and ``NOPAD_ATTN_BACKEND=flash``."""
    monkeypatch.setenv(BACKEND_ENV, "flash")
    return flash_standin("2.6")


@contextlib.contextmanager
def poisoned_default_device(monkeypatch):
    """VarlenMetas built without naming a device land on ``meta`` (see module doc)."""
    with monkeypatch.context() as m:
        m.setattr(VarlenMeta.from_lengths.__func__, "__defaults__", ("meta",))
        m.setitem(VarlenMeta.for_step.__func__.__kwdefaults__, "device", "meta")
        yield


def precision_model(family: str, precision: str):
    model = tiny_model(family)
    if precision != "autocast":
        model = model.to(COMPUTE[precision])
    return model


def precision_context(precision: str):
    if precision == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def packed_step(model, seqs, precision):
    """Packed forward + backward through model(...): logits, per-parameter grads."""
    meta = VarlenMeta.from_lengths([len(s) for s in seqs], device=model.device)
    ids = torch.cat(seqs)[None]
    model.zero_grad(set_to_none=True)
    with use_nopad_attention(model), precision_context(precision):
        logits = model(ids, position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False).logits[0]
        loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def assert_close_rel(got, expected, tol, what):
    scale = max(1.0, float(expected.abs().max()))
    diff = float((got - expected).abs().max())
    assert diff <= tol * scale, f"{what}: max diff {diff:.3e} > {tol} x {scale:.2f}"


# ------------------------------------------------------------------ training through model(...)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_packed_training_on_flash_equals_cpu_path(monkeypatch, flash_standin, family, precision):
    standin = flash_standin("2.6")
    model = precision_model(family, precision)
    seqs = random_sequences([5, 19, 1, 12])  # longer than the sliding window (8), and length 1
    monkeypatch.setenv(BACKEND_ENV, "sdpa_loop")
    cpu_logits, cpu_grads = packed_step(model, seqs, precision)
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with poisoned_default_device(monkeypatch):
        logits, grads = packed_step(model, seqs, precision)
    layers = model.config.num_hidden_layers
    assert len(standin.calls) == layers  # every layer's forward ran on flash-attn ...
    assert {c["dtype"] for c in standin.calls} == {COMPUTE[precision]}  # ... in one compute dtype
    assert all(c["grad"] and not c["paged"] for c in standin.calls)
    if family == "gemma2":
        assert {c["softcap"] for c in standin.calls} == {50.0}
        assert {c["window"] for c in standin.calls} == {(7, 0), (-1, -1)}  # sliding and full layers
    assert_close_rel(logits, cpu_logits, LOGIT_TOL[precision], "logits")
    for name, g in cpu_grads.items():
        scale = float(g.abs().max()) or 1.0
        diff = float((grads[name] - g).abs().max())
        assert diff <= GRAD_TOL[precision] * scale, f"{name}: {diff:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("family,precision", [("llama", "bf16"), ("gemma2", "autocast")])
def test_verify_on_flash(forced_flash, family, precision):
    model = precision_model(family, precision)
    with precision_context(precision):
        report = verify(model, random_sequences([7, 13, 3], seed=1))
    assert forced_flash.calls and "nopad" in report.attention_path
    assert report.ok(logit_rtol=LOGIT_TOL[precision], grad_rtol=GRAD_TOL[precision]), str(report)


def test_hf_generate_and_unpacked_rows_build_their_boundaries_on_the_query_device(monkeypatch, forced_flash):
    """The derived-boundaries paths (no nopad_meta): unpacked rows, and HF generate with its own
    cache, where queries are shorter than keys."""
    model = precision_model("qwen2", "bf16")
    ids = torch.stack(random_sequences([9, 9], seed=2))
    monkeypatch.setenv(BACKEND_ENV, "sdpa_loop")
    with use_nopad_attention(model), torch.no_grad():
        expected_logits = model(ids, use_cache=False).logits.float()
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with poisoned_default_device(monkeypatch), use_nopad_attention(model), torch.no_grad():
        logits = model(ids, use_cache=False).logits.float()
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert_close_rel(logits, expected_logits, LOGIT_TOL["bf16"], "logits")
    assert torch.equal(tokens, expected)
    assert any(c["total_q"] == 2 for c in forced_flash.calls)  # decode steps (1 query per row) ran on flash


# ------------------------------------------------------------------ the generator
def greedy_margins(model, prompt, completion):
    """Top-1 minus top-2 logit at every generated position (fp32 forward)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model.float()(ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@pytest.mark.parametrize(
    "family,precision", [("llama", "bf16"), ("mistral", "fp16"), ("gemma2", "autocast"), ("qwen2", "autocast")]
)
def test_generator_on_flash_reads_blocks_in_place(monkeypatch, flash_standin, family, precision):
    """Chunked prefill, decode, prefix sharing (a 300-token shared prefix, n=2 forks) and
    preemption, all on flash-attn's paged kernel: default block size 256, no gather."""
    from nopad.inference import Generator, SamplingParams

    standin = flash_standin("2.6")
    model = precision_model(family, precision)
    shared = random_sequences([300], seed=3)[0].tolist()
    prompts = [shared + [5, 6, 7], shared + [9], random_sequences([40], seed=4)[0].tolist(), [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=7, ignore_eos=True)

    def run(backend, **kw):
        gen = Generator(model, attn_backend=backend, max_num_batched_tokens=128, **kw)
        with precision_context(precision):
            outs = gen.generate(prompts, params, use_tqdm=False)
            forks = gen.generate(prompts[:2], sampled, use_tqdm=False)
            kv_dtype = gen._kv_cache.k[0].dtype
        return gen, outs, forks, kv_dtype

    _, cpu_outs, cpu_forks, cpu_kv = run("sdpa_loop", num_blocks=64)
    monkeypatch.setattr(attention.dispatch, "gather_kv", lambda *a, **k: pytest.fail("gathered K/V on the flash path"))
    with poisoned_default_device(monkeypatch):
        # 4 blocks of 256 for 4 sequences needing 5 (prefix shared): preemption
        gen, outs, forks, kv_dtype = run("flash", num_blocks=4)
    stats = gen.stats()
    assert gen.block_size == 256 and stats["preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0
    assert max(stats["tokens_per_step"]) <= 128  # chunked prefill
    assert kv_dtype == cpu_kv == COMPUTE[precision]  # the cache holds the compute dtype
    assert standin.calls and all(c["paged"] and c["block_size"] == 256 for c in standin.calls)
    assert {c["dtype"] for c in standin.calls} == {COMPUTE[precision]}
    for prompt, got, ref in zip(prompts, outs, cpu_outs):
        a, b = got.outputs[0].token_ids, ref.outputs[0].token_ids
        # greedy ties may flip in 16-bit: tokens must agree wherever the fp32 margin is clear (all
        # agreed when measured, with margins down to 2.7e-3; the escape is for other CPUs' kernels)
        margins = greedy_margins(tiny_model(family), prompt, b)
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert first_diff is None or margins[first_diff] < 0.05, (a, b, margins)
        if first_diff is None:
            got_lp, ref_lp = torch.tensor(got.outputs[0].logprobs), torch.tensor(ref.outputs[0].logprobs)
            torch.testing.assert_close(got_lp, ref_lp, atol=LOGIT_TOL[precision] * 4, rtol=0)
    for got, ref in zip(forks, cpu_forks):  # seeded samples: the same draws on both paths
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]


# ------------------------------------------------------------------ one GRPO step
def test_one_grpo_step_on_flash_in_bf16(monkeypatch, forced_flash):
    from nopad.inference import Generator, SamplingParams
    from nopad.packing.row import PackedRow
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo import resolve_batch_invariant
    from nopad.training.grpo_step import GRPOStepConfig, grpo_step
    from tests.support.models import IdText, checksum_reward

    policy = precision_model("llama", "bf16")
    prompt_ids = [[5, 6, 7, 8], [9, 10, 11]]
    moved = []
    real_move = PackedRow.to
    monkeypatch.setattr(PackedRow, "to", lambda row, device, **kw: moved.append(device) or real_move(row, device, **kw))
    gen = Generator(policy, num_blocks=8, max_num_batched_tokens=256)
    stepper = OptimizerStepper(policy, torch.optim.SGD(policy.parameters(), lr=1e-2), max_grad_norm=1.0)
    loss = GRPOStepConfig(batch_invariant=resolve_batch_invariant("auto", policy.device))
    before = policy.lm_head.weight.detach().clone()
    with use_nopad_attention(policy):
        metrics = grpo_step(
            stepper, gen, [{}, {}], prompt_ids, checksum_reward, IdText(), SamplingParams(n=4, max_tokens=8), loss
        )
    assert gen.block_size == 256
    assert moved and all(d == policy.device for d in moved)  # every packed row moved to the model
    assert any(c["grad"] for c in forced_flash.calls) and any(c["paged"] for c in forced_flash.calls)
    # same kernel and dtype on both sides: the rollout/trainer log-prob gap is bf16 rounding only
    assert metrics["logprob_gap_max"] < 0.1 and metrics["grad_norm"] > 0
    assert not torch.equal(policy.lm_head.weight, before)


# ------------------------------------------------------------------ the backend rule
def test_backend_rule(monkeypatch, flash_standin):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    flash_standin("2.6")
    assert choose_backend(cuda, torch.bfloat16) == "flash"
    assert choose_backend(cuda, torch.float16) == "flash"
    assert choose_backend(cpu, torch.bfloat16) == "sdpa_loop"
    with pytest.warns(RuntimeWarning, match="fp16/bf16 only.*autocast"):
        assert choose_backend(cuda, torch.float32) == "sdpa_loop"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_backend(cuda, torch.float32) == "sdpa_loop"  # warned once only
    assert choose_backend(cuda, torch.bfloat16, override="sdpa_padded") == "sdpa_padded"
    monkeypatch.setenv(BACKEND_ENV, "sdpa_dense")
    assert choose_backend(cuda, torch.bfloat16) == "sdpa_dense"
    assert choose_backend(cuda, torch.bfloat16, override="sdpa_loop") == "sdpa_loop"  # keyword wins
    monkeypatch.setenv(BACKEND_ENV, "flash")
    assert choose_backend(cpu, torch.bfloat16) == "flash"  # forced, for debugging and these tests
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="NOPAD_ATTN_BACKEND='fast'"):
        choose_backend(cpu, torch.bfloat16)


def test_fp32_on_the_flash_path_never_reaches_flash_attn(forced_flash):
    model = tiny_model("mistral")
    seqs = random_sequences([6, 11])
    with pytest.warns(RuntimeWarning, match="fp16/bf16 only"):
        logits, _ = packed_step(model, seqs, "fp32")
    assert forced_flash.calls == []
    expected = [model(s[None], use_cache=False).logits[0] for s in seqs]
    torch.testing.assert_close(logits, torch.cat(expected).detach(), atol=1e-5, rtol=0)


def test_generator_honours_attn_backend_and_dtype(monkeypatch, flash_standin):
    from nopad.inference import Generator, SamplingParams

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    standin = flash_standin("2.6")
    model = tiny_model("llama")  # fp32 weights
    gen = Generator(model, dtype=torch.bfloat16, attn_backend="flash", num_blocks=4)
    out = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert gen.block_size == 256 and gen._kv_cache.k[0].dtype == torch.bfloat16
    assert standin.calls and {c["dtype"] for c in standin.calls} == {torch.bfloat16}
    assert Generator(model, num_blocks=4).block_size == 16  # CPU, auto: the CPU path's default
    with pytest.raises(ValueError, match="dtype must be a floating"):
        Generator(model, dtype=torch.int8)
    with pytest.raises(ValueError, match="unknown attn_backend 'fast'"):
        Generator(model, attn_backend="fast")


# ------------------------------------------------------------------ flash-attn versions
def test_flash_attn_25_has_no_softcap(monkeypatch, flash_standin):
    flash_standin("2.5")
    info = flash.flash_attn_info()
    assert info.paged and info.window and not info.softcap
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    # a softcap layer: flash-attn 2.5 cannot, torch's varlen kernel has none, FlexAttention can
    assert choose_backend(torch.device("cuda"), torch.bfloat16, softcap=50.0) == "flex"
    assert choose_backend(torch.device("cuda"), torch.bfloat16) == "flash"
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="flash-attn 2 .* has no softcap"):
        packed_step(precision_model("gemma2", "bf16"), random_sequences([4, 3]), "bf16")
    # a model without softcap runs on 2.5, which would raise TypeError if softcap were passed
    logits, _ = packed_step(precision_model("llama", "bf16"), random_sequences([4, 3]), "bf16")
    assert torch.isfinite(logits).all()


def test_flash_attn_that_fails_to_import_falls_back_with_a_warning(monkeypatch, tmp_path, flash_standin):
    for name in ("flash_attn", "flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(broken_package(tmp_path)))
    flash.flash_attn_info.cache_clear()
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="flash_attn is installed but does not import.*libcudart"):
        assert flash.flash_attn_info() is None
    assert choose_backend(torch.device("cuda"), torch.bfloat16) == "torch_varlen"  # torch's own kernel
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(RuntimeError, match="'flash' was requested .* is not installed or does not import"):
        packed_step(precision_model("llama", "bf16"), random_sequences([4, 3]), "bf16")


def test_flash_attn_3_is_detected_and_used(monkeypatch, flash_standin):
    from nopad.inference import Generator, SamplingParams

    standin = flash_standin("3")
    info = flash.flash_attn_info()
    assert info.version == "3" and info.softcap and not info.paged
    monkeypatch.setenv(BACKEND_ENV, "flash")
    model = precision_model("gemma2", "bf16")
    seqs = random_sequences([5, 12])
    logits, _ = packed_step(model, seqs, "bf16")  # FA3 returns (out, lse); no dropout_p accepted
    monkeypatch.setenv(BACKEND_ENV, "sdpa_loop")
    expected, _ = packed_step(model, seqs, "bf16")
    assert_close_rel(logits, expected, LOGIT_TOL["bf16"], "logits")
    monkeypatch.setenv(BACKEND_ENV, "flash")
    standin.calls.clear()
    gen = Generator(model, num_blocks=16)
    assert gen.block_size == 16  # no paged varlen kernel in FA3: small blocks, gathered per layer
    gen.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert standin.calls and not any(c["paged"] for c in standin.calls)


# ------------------------------------------------------------------ unknown attention arguments
def test_an_attention_argument_nopad_does_not_implement_fails_clearly():
    """An argument that carries a value nopad would drop (gpt-oss's ``s_aux`` was one until nopad
    took attention sinks) is refused, naming the model."""
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match=r"LlamaAttention .*'llama'.*\['attn_bias'\]"):
        nopad_attention(attention, q, k, v, None, attn_bias=torch.zeros(1))


def test_varlen_meta_to_keeps_int32_and_returns_self_on_the_same_device():
    meta = VarlenMeta.for_step(
        [1, 2], [3, 0], block_table=torch.zeros(2, 1, dtype=torch.int64), slot_mapping=torch.arange(3)
    )
    assert meta.to("cpu") is meta and meta.device == torch.device("cpu")
    moved = meta.to("meta")
    assert moved.device == torch.device("meta") and moved.block_table.device == torch.device("meta")
    assert moved.cu_seqlens_q.dtype == torch.int32 and moved.block_table.dtype == torch.int32


def test_a_meta_on_another_device_is_moved_once_per_forward():
    """DDP scatters tensors, not a VarlenMeta: the attention layer moves it to the query's device,
    once for all layers of a forward (here "meta" stands for the GPU)."""
    from nopad.packing.attention.plan import AttentionPlan
    from nopad.packing.hf.attention import _forward_meta

    meta = VarlenMeta.from_lengths([3, 2])
    assert meta.to(torch.device("cpu")) is meta
    plan, shape = AttentionPlan(), (1, 5, 5, torch.device("meta"))
    moved = _forward_meta(plan, None, meta, None, shape)
    assert moved.device == torch.device("meta") and moved.position_ids.device == torch.device("meta")
    assert _forward_meta(plan, None, meta, None, shape) is moved  # the next layer reads it from the plan
    assert _forward_meta(AttentionPlan(), None, meta, None, shape) is not moved  # next forward: again
