"""On a CUDA GPU (``pytest -m gpu``; skipped elsewhere): every CUDA attention backend this machine
has gives the reference's packed training forward and backward; the generator's greedy output
equals HF ``generate``; the static decode step captured as a CUDA graph picks the same tokens; no
layer syncs with the host; ``release()`` hands the KV memory back; and the Triton kernel keeps its
bitwise batch invariance natively (the CPU suite proves it only under the interpreter).

Nothing here has run on a GPU yet: the first session with one runs ``make gpu-check``.
"""

from __future__ import annotations

import pytest
import torch

from tests.models import random_sequences, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu)"),
]

CUDA_BACKENDS = ("sdpa_loop", "torch_varlen", "flex", "triton", "flash")
GREEDY_TOKENS = 12


def available(backend: str, dtype: torch.dtype) -> bool:
    from packing.attention.registry import Call, backends

    table = backends()
    call = Call(device=torch.device("cuda"), dtype=dtype, grad=True)
    return backend in table and table[backend].gap(call) is None


def packed_forward_backward(model, sequences, backend: str, monkeypatch):
    """Logits and the gradient of their sum over one packed row, attention forced to ``backend``."""
    from dataloaders.collator import PackedCollator
    from packing.hf import use_nopad_attention

    monkeypatch.setenv("NOPAD_ATTN_BACKEND", backend)
    model.zero_grad(set_to_none=True)
    row = PackedCollator()([{"input_ids": s.tolist(), "index": i} for i, s in enumerate(sequences)])
    with use_nopad_attention(model):
        logits = model(input_ids=row["input_ids"].cuda(), position_ids=row["position_ids"].cuda(),
                       nopad_meta=row["nopad_meta"].to("cuda")).logits
    logits.float().square().mean().backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_training_equals_unpacked_reference_on_each_backend(backend, family, monkeypatch):
    dtype = torch.bfloat16
    if not available(backend, dtype):
        pytest.skip(f"{backend} is not available on this machine")
    model = tiny_model(family).to("cuda", dtype)
    sequences = random_sequences([37, 5, 80, 16], seed=3)
    got, grads = packed_forward_backward(model, sequences, backend, monkeypatch)
    want, want_grads = packed_forward_backward(model, sequences, "sdpa_loop", monkeypatch)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name].float(), grad.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("static_decode", [False, True])
def test_greedy_generation_equals_hf_generate(family, static_decode):
    from inference import Generator, SamplingParams

    model = tiny_model(family).to("cuda", torch.float32)
    prompts = [s.tolist() for s in random_sequences([9, 30, 3], seed=4)]
    gen = Generator(model, num_blocks=64, static_decode=static_decode)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = gen.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                              min_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0)[0, len(prompt):]
        assert out.outputs[0].token_ids == want.tolist()
    if static_decode:
        assert gen._runner.static_steps > 0


def test_static_decode_captured_as_a_cuda_graph_gives_the_same_tokens():
    from inference import Generator, SamplingParams

    model = tiny_model("llama").to("cuda", torch.bfloat16)
    prompts = [s.tolist() for s in random_sequences([9, 30, 3], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in Generator(model, num_blocks=64).generate(prompts, params)]
    torch._dynamo.reset()
    compiled = Generator(model, num_blocks=64, compile_decode=True)
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, params)] == eager
    assert compiled._runner.static_steps > 0


def test_no_per_layer_host_sync_on_the_gpu():
    from tests.test_inference_step_syncs import GREEDY, PROMPTS, count_steps

    def counts(layers):
        from inference import Generator

        gen = Generator(tiny_model("llama", num_hidden_layers=layers).to("cuda"), max_num_batched_tokens=8)
        for p in PROMPTS:
            gen.add_request(p, GREEDY)
        return count_steps(gen, 6)

    assert counts(2) == counts(6)


def test_release_gives_the_kv_memory_back():
    from inference import Generator, SamplingParams

    model = tiny_model("llama").to("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gen = Generator(model, num_blocks=512)
    gen.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert torch.cuda.memory_allocated() > before
    gen.release()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


def test_triton_kernel_is_batch_invariant_natively():
    """The interpreter-run invariance tests of the Triton kernel, on CUDA tensors with the real
    compiled kernel (TRITON_INTERPRET must be unset: conftest only sets it without a GPU)."""
    import os

    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET on a GPU machine"
    from packing.attention import triton_kernel
    from packing.varlen import VarlenMeta

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        g = torch.Generator(device="cuda").manual_seed(0)
        lengths = [37, 5, 80]
        q, k, v = (torch.randn(sum(lengths), n, 64, device="cuda", generator=g).to(dtype) for n in (8, 2, 2))
        packed = triton_kernel.forward(q, k, v, VarlenMeta.from_lengths(lengths).to("cuda"), scale=0.125)
        start = 0
        for n in lengths:
            alone = triton_kernel.forward(q[start:start + n], k[start:start + n], v[start:start + n],
                                          VarlenMeta.from_lengths([n]).to("cuda"), scale=0.125)
            assert torch.equal(alone, packed[start:start + n]), (dtype, n)
            start += n
