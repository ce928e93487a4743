"""nopad on a real GPU: run by ``pytest -m gpu`` (and ``make gpu-check``); collected and skipped without CUDA.

The Triton kernel's bitwise invariance tests
(tests/packing/test_packing_triton_attention.py) run natively on CUDA
as they are (their device is CUDA when there is one); ``benchmarks/gpu_check.py`` runs that file too.
"""

from __future__ import annotations

import pytest
import torch

from nopad.inference.generator import Generator
from nopad.inference.graph_sampler import DrawSpec
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.step_inputs import row_bucket
from nopad.packing.attention import varlen_attention
from nopad.packing.attention.registry import Call, backends
from nopad.packing.varlen import VarlenMeta
from tests.inference.test_inference_step_syncs import GREEDY, PROMPTS, count_steps
from tests.packing.test_packing_attention import naive
from tests.support.models import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
GPU_BACKENDS = ("sdpa_loop", "torch_varlen", "flex", "triton", "flash")


def usable(name: str, **call) -> bool:
    """True when this machine's libraries let ``name`` run such a call on CUDA in bf16."""
    backend = backends().get(name)
    if backend is None:
        return False
    return backend.gap(Call(CUDA, torch.bfloat16, **call), forced=True) is None


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_packed_training_forward_and_backward_equal_the_reference(backend):
    if not usable(backend, grad=True):
        pytest.skip(f"{backend} cannot run bf16 training rows on this machine")
    lengths = [1, 37, 128, 5, 300, 64]
    meta = VarlenMeta.from_lengths(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(meta.total_q, h, 64, generator=g) for h in (8, 2, 2))
    leaves = [t.to(CUDA, torch.bfloat16).requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.to(torch.bfloat16).float().requires_grad_() for t in (q, k, v)]  # fp32 maths, CPU
    out = varlen_attention(*leaves, meta.to(CUDA), backend=backend)
    ref = naive(*ref_leaves, meta)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn(meta.total_q, 8, 64, generator=g)
    (out.float() * grad.to(CUDA)).sum().backward()
    (ref * grad).sum().backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad.float().cpu(), b.grad, atol=5e-2, rtol=5e-2)


def _greedy(model, **gen_kwargs) -> list[list[int]]:
    return _greedy_run(model, **gen_kwargs)[0]


def _greedy_run(model, **gen_kwargs) -> tuple[list[list[int]], Generator]:
    gen = Generator(model, max_num_batched_tokens=64, **gen_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in gen.generate(PROMPTS, params)], gen


def _graph_kinds(gen: Generator) -> set:
    """The kinds of compiled step a generator ran (None: logits; else the DrawSpec of its draws): one graph each."""
    return {spec for _, spec in gen._runner._variants}


def _hf_greedy(model) -> list[list[int]]:
    out = []
    for p in PROMPTS:  # one prompt at a time: no padding, the plain reference
        ids = torch.tensor([p], device=CUDA)
        gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_generator_greedy_equals_hf_generate(family):
    model = tiny_model(family).to(CUDA).eval()
    with torch.no_grad():
        assert _greedy(model) == _hf_greedy(model)


def test_static_decode_in_a_cuda_graph_gives_the_same_tokens():
    """compile_decode captures the static decode step as CUDA graphs (mode="reduce-overhead")."""
    model = tiny_model("llama").to(CUDA).eval()
    with torch.no_grad():
        eager = _greedy(model)
        assert _greedy(model, static_decode=True) == eager
        assert _greedy(model, compile_decode=True) == eager


def test_the_cuda_graph_draws_a_steady_decode_steps_rows():
    """compile_decode on CUDA draws greedy and tempered rows inside the step's graph (graph_draws is on
    by default there): one graph per variant, no graph break, no cudagraph skip; the eager sampler's
    greedy tokens on the same compiled logits, and the sampled rows' log-probs within float rounding
    where they drew the same token (the fused kernels round differently from ATen's)."""
    from torch._dynamo.utils import counters

    from tests.inference.test_inference_graph_sampler import PROMPTS as MIXED_PROMPTS
    from tests.inference.test_inference_graph_sampler import mixed_params, records

    model = tiny_model("llama").to(CUDA).eval()
    runs = {}
    for draws in (True, False):
        torch._dynamo.reset()
        before = (sum(counters["graph_break"].values()), counters["inductor"]["cudagraph_skips"])
        gen = Generator(model, block_size=16, max_num_batched_tokens=64, compile_decode=True)
        assert gen._ensure_runner().graph_draws  # the default on CUDA
        gen._runner.graph_draws = draws
        with torch.no_grad():
            outs = gen.generate(MIXED_PROMPTS, mixed_params(), use_tqdm=False)
        after = (sum(counters["graph_break"].values()), counters["inductor"]["cudagraph_skips"])
        assert after == before
        assert (gen.stats()["graph_draw_steps"] > 0) == draws
        runs[draws] = records(outs)
    params = [p for p in mixed_params() for _ in range(p.n)]
    for p, a, b in zip(params, runs[True], runs[False]):
        if p.temperature == 0:
            assert a[0] == b[0]
        same = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), len(a[0]))  # up to a first flip
        for x, y in zip(a[1:4], b[1:4]):
            torch.testing.assert_close(torch.tensor(x[:same]), torch.tensor(y[:same]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_the_cuda_uniforms_are_the_hosts_bit_for_bit(compiled):
    """The compiled step's counter RNG on CUDA (eager kernels, and inductor's Triton: int64 arithmetic
    must wrap as uint64's) gives every row the host's float64, so a graph-drawn row draws the token an
    eager-drawn one would."""
    from nopad.inference.seeding import uniform_array, uniform_tensor
    from tests.inference.test_inference_sampling import random_keys

    keys, lengths = random_keys()
    torch._dynamo.reset()
    fn = torch.compile(uniform_tensor) if compiled else uniform_tensor
    got = fn(torch.from_numpy(keys.view("int64")).to(CUDA), torch.from_numpy(lengths).to(CUDA))
    assert got.cpu().tolist() == uniform_array(keys, lengths).tolist()


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "bamba"])
def test_hybrid_decode_in_a_cuda_graph_gives_hf_tokens(family):
    """compile_decode on hybrid layers (delta rule, short conv, Mamba2): the state slots read
    and written in place inside the CUDA graph, one compilation, no graph break, no cudagraph skip
    (a skip or break would leave the step host-bound), and the tokens of HF generate, fp32."""
    from torch._dynamo.utils import counters

    from tests.inference.test_inference_hybrid import hybrid_model

    model = hybrid_model(family).to(CUDA).eval()
    torch._dynamo.reset()
    before = (
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        counters["inductor"]["cudagraph_skips"],
    )
    with torch.no_grad():
        reference = _hf_greedy(model)
        assert _greedy(model) == reference
        assert _greedy(model, static_decode=True) == reference
        compiled, gen = _greedy_run(model, compile_decode=True)
        assert compiled == reference
    after = (
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        counters["inductor"]["cudagraph_skips"],
    )
    kinds = _graph_kinds(gen)  # the general step's logits and the decode batch's greedy draws, on CUDA
    assert DrawSpec() in kinds and gen.stats()["graph_draw_steps"] > 0  # the all-greedy draws
    assert [b - a for a, b in zip(before, after)] == [len(kinds), 0, 0]


def test_compiled_decode_compiles_once_and_records_each_bucket_once():
    """One compilation serves every bucket and Generator (rows and table width dynamic), and
    reduce-overhead records each bucket's CUDA graph once, then replays it: compiled per bucket,
    the H200 spent 1.2 s per decode step at 128 rows after a 64-row Generator."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    def recordings() -> int:
        return len(compilation_time_metrics.get("CUDAGraphNode.record", []))

    model = tiny_model("llama").to(CUDA).eval()
    torch._dynamo.reset()
    graphs, recorded, skips, buckets = (
        counters["stats"]["unique_graphs"],
        recordings(),
        counters["inductor"]["cudagraph_skips"],
        0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kinds = set()  # one graph per kind of step (logits, greedy draws in the graph), not per bucket
    with torch.no_grad():
        for num in (3, 9):  # 4 then 16 rows; blocks of 16: the table widens 2 -> 4 within each run
            gen = Generator(model, block_size=16, max_num_batched_tokens=512, compile_decode=True)
            gen.generate([[5 + i] * 20 for i in range(num)], params)
            assert gen._runner.static_shapes == {(row_bucket(num), 2), (row_bucket(num), 4)}
            buckets += len(gen._runner.static_shapes)
            kinds |= _graph_kinds(gen)
    assert counters["stats"]["unique_graphs"] - graphs == len(kinds) <= 2
    assert 0 < recordings() - recorded <= buckets * len(kinds)
    assert counters["inductor"]["cudagraph_skips"] == skips


def test_no_per_layer_host_sync():
    def counts(layers):
        gen = Generator(tiny_model("llama", num_hidden_layers=layers).to(CUDA), max_num_batched_tokens=8)
        for p in PROMPTS:
            gen.add_request(p, GREEDY)
        return count_steps(gen, 6)

    assert counts(2) == counts(6)


def test_release_gives_the_kv_memory_back():
    model = tiny_model("llama").to(CUDA).eval()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gen = Generator(model, num_blocks=4096, block_size=16, max_num_batched_tokens=64)
    with torch.no_grad():
        gen.generate(PROMPTS, GREEDY)
    held = torch.cuda.memory_allocated()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * 4096 * 16 * cfg.num_key_value_heads * head_dim * 4  # fp32 K and V
    assert held - before >= kv_bytes
    gen.release()
    del gen
    torch.cuda.synchronize()
    assert held - torch.cuda.memory_allocated() >= kv_bytes


@pytest.mark.parametrize("op", ["sum", "mean", "softmax", "log_softmax"])
def test_batch_invariant_reductions_keep_autocasts_dtypes(op):
    """The Triton set's routed reductions give the dtype torch gives under CUDA autocast (fp32 for
    sum / softmax / log_softmax of bf16 input), not the input's."""
    from nopad.packing.invariance import batch_invariant

    x = torch.randn(6, 40, device=CUDA, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = getattr(x, op)(-1)
        with batch_invariant():
            routed = getattr(x, op)(-1)
    assert routed.dtype == expected.dtype
    torch.testing.assert_close(routed.float(), expected.float(), atol=2e-2, rtol=2e-2)
