"""Hybrid layers and sinks on a real GPU: run by ``pytest -m gpu``; skipped without CUDA.

On CUDA the mixers dispatch to ``fla`` (Gated DeltaNet, KDA) when it is installed, and to nopad's
own varlen reference where it is not (and for the short convolution and Mamba2 scan without
``causal-conv1d`` / ``mamba_ssm``). These tests check both the packed rows and the generator there,
as the CPU suite does on the reference: packed == each sequence alone, greedy == HF ``generate``,
and bitwise rollout == trainer in ``nopad.packing.batch_invariant()``.

With fla installed, transformers' own layer runs fla too (its kernel hook picks the package on any
device), so "alone" is fla's unpacked call and "packed" fla's varlen one. fla 0.6 refuses its Gated
DeltaNet backward on Hopper under Triton 3.4 to 3.7.0 (the lent H200's Triton 3.6; fla #640): there
HF's own layer cannot train on fla, nopad falls back to its reference (one warning), and the
gradient check runs both sides on transformers' torch function while fla's forward is checked
packed against alone.
"""

from __future__ import annotations

import inspect
import sys
import warnings

import pytest
import torch

from nopad import packing
from nopad.inference import Generator, SamplingParams
from nopad.packing.hf import use_nopad_attention
from nopad.packing.invariance import batch_invariant
from nopad.packing.mixers import delta_rule, kernels
from nopad.packing.mixers.hf_kernels import dispatcher
from nopad.packing.varlen import VarlenMeta
from nopad.training.grpo import Rollout
from tests.inference.test_inference_generator import prompts_of
from tests.inference.test_inference_hybrid import hybrid_model
from tests.packing.test_packing_invariance_hybrid import hybrid_model as invariance_model
from tests.packing.test_packing_invariance_hybrid import trainer_logprobs
from tests.support.models import random_sequences, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def full_fp32():
    """fp32 matmuls in fp32 (not TF32), so the fp32 bars below are the CPU suite's."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def fla_backward_refusal() -> str | None:
    """Why fla's Gated DeltaNet cannot train on this GPU (its backward's error), or None."""
    return delta_rule.fla_backward_error(CUDA)


def hf_rule_on_torch(monkeypatch, model) -> None:
    """transformers' own calls of the layer's gated delta rule on its torch function (as without
    fla); nopad's packed calls still reach nopad through the same dispatcher."""
    module = sys.modules[type(model).__module__]
    torch_rule = inspect.unwrap(module.torch_chunk_gated_delta_rule)
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", dispatcher("chunk_gated_delta_rule", torch_rule))


def fresh_kernel_choice(monkeypatch) -> None:
    """No package disabled, no fla backward tried yet, for this test only."""
    monkeypatch.setattr(kernels, "_BROKEN", set())
    monkeypatch.setattr(delta_rule, "_BACKWARD_RUNS", set())


# fla's Triton dots round fp32 operands to TF32 on CUDA (tl.dot's default, and fla's own choice for
# its triangular solve; torch's TF32 flags do not reach them), so an ulp that differs between the
# packed row's projections and a sequence's own can move a product by 2^-11 of it: 1e-4, not the
# CPU suite's 1e-5
LOGIT_BAR, GRAD_BAR = 1e-4, 1e-4


# KDA last: fla autotunes its kernels on first use (minutes on the H100), so a per-test timeout
# there does not hide the others
@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "bamba", "gpt_oss", "kimi_linear"])
def test_packed_rows_equal_each_sequence_alone_on_cuda(family, monkeypatch):
    fresh_kernel_choice(monkeypatch)
    model = tiny_model(family).to(CUDA)
    refusal = fla_backward_refusal() if family == "qwen3_5" else None
    if refusal:
        hf_rule_on_torch(monkeypatch, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = packing.verify(model, random_sequences((1, 70, 5, 13, 64)))
    scale = max(1.0, report.logit_scale)
    numbers = (
        f"{report}; bars: logits {LOGIT_BAR * scale:.1e}, gradient {GRAD_BAR:.0e}"
        f"{'; fla refuses its backward here: ' + refusal if refusal else ''}"
    )
    assert report.max_logit_diff <= LOGIT_BAR * scale, numbers
    assert report.grad_rel_diff <= GRAD_BAR, numbers
    if refusal:  # nopad said so once and trained on its reference
        assert any("backward fails on this device" in str(w.message) for w in caught), numbers


def test_fla_runs_the_packed_delta_rule_when_installed(monkeypatch):
    if not kernels.installed("fla"):
        pytest.skip("fla is not installed: the reference runs (covered by the test above)")
    import fla.ops.gated_delta_rule as fla_rule

    fresh_kernel_choice(monkeypatch)  # fla as it imports, not as a test before found its backward
    calls = []
    real = fla_rule.chunk_gated_delta_rule

    def counted(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fla_rule, "chunk_gated_delta_rule", counted)
    model = tiny_model("qwen3_5").to(CUDA).eval()
    seqs = [s.to(CUDA) for s in random_sequences((7, 40, 3, 64, 1))]
    meta = VarlenMeta.from_lengths([len(s) for s in seqs], device=CUDA)
    with torch.no_grad():  # forward only: fla's backward may refuse this GPU (see the module docstring)
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in seqs])
        with use_nopad_attention(model):
            packed = model(
                torch.cat(seqs)[None], position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False
            ).logits[0]
    assert any(cu is not None for cu in calls), "the packed row did not reach fla with cu_seqlens"
    gap, bar = float((packed - alone).abs().max()), LOGIT_BAR * max(1.0, float(alone.abs().max()))
    assert gap <= bar, f"fla packed vs alone: max logit diff {gap:.2e}, bar {bar:.1e}"


def _hf_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt], device=CUDA)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "bamba"])
def test_generator_greedy_equals_hf_generate_on_cuda(family):
    model = hybrid_model(family).to(CUDA).eval()
    prompts = prompts_of([1, 5, 17, 3, 40])
    gen = Generator(model, block_size=16, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with torch.no_grad():
        ours = [o.outputs[0].token_ids for o in gen.generate(prompts, params, use_tqdm=False)]
        theirs = [_hf_greedy(model, p, 8) for p in prompts]
    assert ours == theirs


def _rollouts_in_exact_mode(model):
    prompts = [p.tolist() for p in random_sequences([3, 23, 1, 30], seed=8)]
    params = SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=1)
    gen = Generator(model, max_num_batched_tokens=7, max_num_seqs=3, num_blocks=48, block_size=16)
    outs = gen.generate(prompts, params, use_tqdm=False)
    return [
        Rollout(list(p), list(c.token_ids), list(c.logprobs))
        for p, o in zip(prompts, outs)
        for c in o.outputs
        if c.token_ids
    ]


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5", "bamba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rollout_logprobs_equal_the_trainers_bitwise_on_cuda(family, dtype):
    """Short convolutions, the delta rule and the Mamba2 scan token by token, their sums over the
    state in the mode's Triton row kernel: a decode step's bits are a training row's."""
    model = invariance_model(family, dtype).to(CUDA)
    with batch_invariant():
        rollouts = _rollouts_in_exact_mode(model)
        trainer, generator = trainer_logprobs(model, rollouts, 64, shared_prefix=False)
    assert trainer.numel() == generator.numel() > 0
    gap = float((trainer.cpu() - generator.cpu()).abs().max())
    assert torch.equal(trainer.cpu(), generator.cpu()), f"{family} {dtype}: max gap {gap:.3g} (bar: bitwise)"
