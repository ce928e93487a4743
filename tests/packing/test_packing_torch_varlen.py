"""PyTorch's own FlashAttention varlen kernel (``torch_varlen``), forced through nopad's public entry
points on a strict CPU stand-in (tests/support/torch_varlen_standin.py): packed training, verify,
shared-prefix
rows, the generator reading 256-token pages in place, and the backend rule per torch version."""

from __future__ import annotations

import pytest
import torch

from nopad.packing import attention, verify
from nopad.packing.attention import BACKEND_ENV, choose_backend, paged_block_size, varlen_attention
from nopad.packing.hf import use_nopad_attention
from nopad.packing.varlen import VarlenMeta
from tests.packing.test_packing_precision import (
    COMPUTE,
    GRAD_TOL,
    LOGIT_TOL,
    assert_close_rel,
    greedy_margins,
    packed_step,
    poisoned_default_device,
    precision_context,
    precision_model,
)
from tests.support.models import random_sequences, tiny_model
from tests.support.torch_varlen_standin import TorchVarlenStandIn

CUDA = torch.device("cuda")


@pytest.fixture
def torch_varlen(monkeypatch):
    """``install(version)`` replaces torch's ``varlen_attn`` with the stand-in of that version and
    hides any flash-attn, so the rule's next choice is torch's own kernel."""
    import torch.nn.attention.varlen as varlen_module

    from nopad.packing.attention import flash

    def install(version: str = "2.12") -> TorchVarlenStandIn:
        standin = TorchVarlenStandIn(version)
        monkeypatch.setattr(varlen_module, "varlen_attn", standin.varlen_attn)
        monkeypatch.setattr(flash, "flash_attn_info", lambda: None)
        attention.registry._said.clear()
        return standin

    yield install
    attention.registry._said.clear()


def test_backend_rule_by_torch_version(monkeypatch, torch_varlen):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    torch_varlen("2.12")
    assert choose_backend(CUDA, torch.bfloat16) == "torch_varlen"
    assert choose_backend(CUDA, torch.float16, sliding_window=8, grad=True) == "torch_varlen"
    assert choose_backend(CUDA, torch.bfloat16, softcap=50.0) == "flex"  # no softcap in torch's kernel
    assert choose_backend(CUDA, torch.bfloat16, paged=True, block_size=256) == "torch_varlen"
    assert paged_block_size(CUDA, torch.bfloat16) == 256  # the generator allocates what it reads in place
    assert choose_backend("cpu", torch.bfloat16) == "sdpa_loop"  # CUDA only under "auto"
    torch_varlen("2.10")  # no block_table yet: paged steps are not read in place by torch's kernel
    assert choose_backend(CUDA, torch.bfloat16, sliding_window=8) == "torch_varlen"
    assert paged_block_size(CUDA, torch.bfloat16) == 16
    torch_varlen("2.9")  # no scale=: cannot serve HF layers, which pass their own scaling
    with pytest.warns(RuntimeWarning, match="torch_varlen.*too old.*torch >= 2.10"):
        assert choose_backend(CUDA, torch.bfloat16) == "sdpa_loop"
    monkeypatch.setenv(BACKEND_ENV, "torch_varlen")
    with pytest.raises(ValueError, match="'torch_varlen' was requested .* too old"):
        choose_backend(CUDA, torch.bfloat16)


@pytest.mark.parametrize("family,precision", [("llama", "bf16"), ("qwen2", "fp16"), ("mistral", "autocast")])
@pytest.mark.parametrize("version", ["2.10", "2.12"])
def test_packed_training_on_torch_varlen_equals_cpu_path(monkeypatch, torch_varlen, family, precision, version):
    standin = torch_varlen(version)
    model = precision_model(family, precision)
    seqs = random_sequences([5, 19, 1, 12])  # longer than the sliding window (8), and length 1
    monkeypatch.setenv(BACKEND_ENV, "sdpa_loop")
    cpu_logits, cpu_grads = packed_step(model, seqs, precision)
    monkeypatch.setenv(BACKEND_ENV, "torch_varlen")
    with poisoned_default_device(monkeypatch):
        logits, grads = packed_step(model, seqs, precision)
    assert len(standin.calls) == model.config.num_hidden_layers
    assert {c["dtype"] for c in standin.calls} == {COMPUTE[precision]}
    assert all(c["grad"] and not c["paged"] for c in standin.calls)
    gqa = model.config.num_key_value_heads != model.config.num_attention_heads
    # torch 2.12 reads GQA K/V as they are; 2.10 has no enable_gqa, so nopad repeats the KV heads
    assert {c["kv_heads"] for c in standin.calls} == {
        model.config.num_key_value_heads if version == "2.12" else model.config.num_attention_heads
    }
    assert {c["gqa"] for c in standin.calls} == {gqa and version == "2.12"}
    if family == "mistral":
        assert {c["window"] for c in standin.calls} == {(7, 0)}
    assert_close_rel(logits, cpu_logits, LOGIT_TOL[precision], "logits")
    for name, g in cpu_grads.items():
        scale = float(g.abs().max()) or 1.0
        assert float((grads[name] - g).abs().max()) <= GRAD_TOL[precision] * scale, name


def test_softcap_model_forced_onto_torch_varlen_is_refused(monkeypatch, torch_varlen):
    torch_varlen("2.12")
    monkeypatch.setenv(BACKEND_ENV, "torch_varlen")
    with pytest.raises(ValueError, match="'torch_varlen' was requested .* has no softcap"):
        packed_step(precision_model("gemma2", "bf16"), random_sequences([4, 3]), "bf16")


def test_verify_and_shared_prefix_rows_on_torch_varlen(monkeypatch, torch_varlen):
    standin = torch_varlen("2.12")
    monkeypatch.setenv(BACKEND_ENV, "torch_varlen")
    model = precision_model("llama", "bf16")
    report = verify(model, random_sequences([7, 13, 3], seed=1))
    assert standin.calls and report.ok(logit_rtol=LOGIT_TOL["bf16"], grad_rtol=GRAD_TOL["bf16"]), str(report)
    # a shared-prefix row: the keys are gathered through the key index, then torch's kernel runs
    meta = VarlenMeta.shared_prefix([(6, [3, 5])])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(meta.total_q, 4, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    got = varlen_attention(q, k, v, meta, sliding_window=4)
    ref = varlen_attention(q.float(), k.float(), v.float(), meta, sliding_window=4, backend="sdpa_loop")
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=0)
    assert standin.calls[-1]["num_seqs"] == 3 and not standin.calls[-1]["paged"]


def test_a_paged_step_with_grad_is_refused_by_the_standin(torch_varlen):
    """block_table is inference-only in torch: nopad gathers instead of handing it a paged cache
    when a backward is needed; the stand-in itself refuses such a call, as torch does."""
    standin = torch_varlen("2.12")
    k = torch.zeros(2, 256, 1, 8, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="inference-only"):
        standin.varlen_attn(
            q,
            k,
            k,
            cu,
            cu,
            1,
            1,
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            seqused_k=torch.ones(1, dtype=torch.int32),
        )


@pytest.mark.parametrize("family,precision", [("llama", "bf16"), ("mistral", "fp16")])
def test_generator_on_torch_varlen_reads_pages_in_place(monkeypatch, torch_varlen, family, precision):
    """Chunked prefill, decode and a shared prefix on torch's paged kernel: 256-token
    blocks chosen by the generator itself, no gather; greedy tokens agree with the CPU path."""
    from nopad.inference import Generator, SamplingParams

    standin = torch_varlen("2.12")
    model = precision_model(family, precision)
    shared = random_sequences([300], seed=3)[0].tolist()
    prompts = [shared + [5, 6, 7], shared + [9], random_sequences([40], seed=4)[0].tolist(), [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(backend, **kw):
        gen = Generator(model, attn_backend=backend, max_num_batched_tokens=128, **kw)
        with precision_context(precision):
            return gen, gen.generate(prompts, params, use_tqdm=False)

    _, cpu_outs = run("sdpa_loop", num_blocks=64)
    monkeypatch.setattr(attention.dispatch, "gather_kv", lambda *a, **k: pytest.fail("gathered K/V"))
    with poisoned_default_device(monkeypatch):
        gen, outs = run("torch_varlen", num_blocks=4)
    assert gen.block_size == 256 and max(gen.stats()["tokens_per_step"]) <= 128  # chunked prefill
    assert standin.calls and all(c["paged"] and c["block_size"] == 256 for c in standin.calls)
    for prompt, got, ref in zip(prompts, outs, cpu_outs):
        a, b = got.outputs[0].token_ids, ref.outputs[0].token_ids
        margins = greedy_margins(tiny_model(family), prompt, b)
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert first_diff is None or margins[first_diff] < 0.05, (a, b, margins)


def test_torch_varlen_has_no_model_state(torch_varlen):
    """A model left on "nopad" attention keeps working after the stand-in is gone (nothing cached)."""
    torch_varlen("2.12")
    model = tiny_model("llama")
    with use_nopad_attention(model), torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), use_cache=False).logits
    assert torch.isfinite(out).all()
