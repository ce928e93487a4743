"""Hybrid layers and sinks on a real GPU (issue 36): run by ``pytest -m gpu``; skipped without CUDA.

On CUDA the mixers dispatch to ``fla`` (Gated DeltaNet, KDA) when it is installed, and to nopad's
own varlen reference where it is not (and for the short convolution and Mamba2 scan without
``causal-conv1d`` / ``mamba_ssm``). These tests check both the packed rows and the generator there,
as the CPU suite does on the reference: packed == each sequence alone, greedy == HF ``generate``,
and bitwise rollout == trainer in ``packing.batch_invariant()``.
"""

from __future__ import annotations

import pytest
import torch

import packing
from inference import Generator, SamplingParams
from packing.invariance import batch_invariant
from packing.mixers import kernels
from tests.inference.test_inference_generator import prompts_of
from tests.inference.test_inference_hybrid import hybrid_model
from tests.packing.test_packing_invariance_hybrid import hybrid_model as invariance_model
from tests.packing.test_packing_invariance_hybrid import trainer_logprobs
from tests.support.models import random_sequences, tiny_model
from training.grpo import Rollout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def full_fp32():
    """fp32 matmuls in fp32 (not TF32), so the fp32 bars below are the CPU suite's."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "lfm2", "bamba", "gpt_oss"])
def test_packed_rows_equal_each_sequence_alone_on_cuda(family):
    model = tiny_model(family).to(CUDA)
    report = packing.verify(model, random_sequences((1, 70, 5, 13, 64)))
    scale = max(1.0, report.logit_scale)
    # fla's Triton kernels sum in another order than its unpacked call on a shorter row: 1e-4, not 1e-5
    assert report.max_logit_diff <= 1e-4 * scale, report
    assert report.grad_rel_diff <= 1e-4, report


def test_fla_runs_the_packed_delta_rule_when_installed(monkeypatch):
    if not kernels.installed("fla"):
        pytest.skip("fla is not installed: the reference runs (covered by the test above)")
    import fla.ops.gated_delta_rule as fla_rule

    calls = []
    real = fla_rule.chunk_gated_delta_rule

    def counted(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fla_rule, "chunk_gated_delta_rule", counted)
    model = tiny_model("qwen3_5").to(CUDA)
    assert packing.verify(model, random_sequences((7, 40, 3))).max_logit_diff < 1e-2
    assert any(cu is not None for cu in calls), "the packed row did not reach fla with cu_seqlens"


def _hf_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt], device=CUDA)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


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


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "bamba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rollout_logprobs_equal_the_trainers_bitwise_on_cuda(family, dtype):
    model = invariance_model(family, dtype).to(CUDA)
    prompts = [p.tolist() for p in random_sequences([3, 23, 1, 30], seed=8)]
    params = SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=1)
    with batch_invariant():
        gen = Generator(model, max_num_batched_tokens=7, max_num_seqs=3, num_blocks=48, block_size=16)
        outs = gen.generate(prompts, params, use_tqdm=False)
        rollouts = [Rollout(list(p), list(c.token_ids), list(c.logprobs)) for p, o in zip(prompts, outs)
                    for c in o.outputs if c.token_ids]
        trainer, generator = trainer_logprobs(model, rollouts, 64, shared_prefix=False)
    assert trainer.numel() == generator.numel() > 0
    assert torch.equal(trainer.cpu(), generator.cpu()), f"max gap {(trainer.cpu() - generator.cpu()).abs().max():.3g}"
