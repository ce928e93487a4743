"""GPU readiness, checked on CPU: a generation step's host syncs and host-to-device copies must
not grow with the number of layers (on CUDA each one stalls the launch queue once per layer).

A ``TorchDispatchMode`` sees the aten ops that force a device->host sync (``_local_scalar_dense``
behind ``item()``/``int()``/``bool()``, ``equal``, ``nonzero``, ``repeat_interleave`` without
``output_size``) and every copy (``_to_copy``/``copy_``, and ``lift_fresh``, which is
``torch.tensor(python_data)``: a host-to-device copy on CUDA). A ``TorchFunctionMode`` sees the
tensor methods that read a device tensor back (``tolist``, ``numpy``, ``cpu``, ``item``), which on
CPU never reach the dispatcher. The same steps run on tiny models of 2 and 6 layers and the counts
must be equal. ``build_step`` on the ``meta`` device shows the step's host->device copies (on CPU a
copy to CPU is a no-op and invisible): exactly one per step.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_decode_host import gc_held, python_calls
from nopad.inference import Generator, SamplingParams
from nopad.inference.model_runner import ModelRunner
from nopad.inference.step_inputs import DeviceIds, build_step, decode_step, row_bucket
from tests.support.models import tiny_model

SYNC_OPS = {"_local_scalar_dense", "equal", "nonzero", "masked_select"}
COPY_OPS = {"_to_copy", "copy_", "lift_fresh", "lift_fresh_copy"}
READBACK_METHODS = {"tolist", "numpy", "cpu", "item"}
# Python calls in nopad_attention per decode layer after the first (the Triton path, launch stubbed):
# 39 eager and 28 static at this commit (58 and 39 before the per-layer work was cut)
LAYER_CALL_BUDGET = {False: 42, True: 32}


class StepOps(TorchDispatchMode):
    """Count sync-forcing ops, copies and host->other-device copies."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.counts[name] += 1
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.counts["repeat_interleave(no output_size)"] += 1
        if name in COPY_OPS:
            self.counts[name] += 1
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device") or src.device
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and torch.device(dst).type != "cpu":
                self.counts["host_to_device"] += 1
        return func(*args, **kwargs)


class ReadBacks(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READBACK_METHODS:
            self.counts[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


def count_steps(gen: Generator, steps: int) -> list[Counter]:
    per_step = []
    for _ in range(steps):
        mode = StepOps()
        with mode, ReadBacks(mode.counts):
            gen.step()
        per_step.append(mode.counts)
    return per_step


def run_counts(layers: int, prompts, params, steps: int, **gen_kwargs) -> list[Counter]:
    model = tiny_model("llama", num_hidden_layers=layers)
    gen = Generator(model, block_size=4, max_num_batched_tokens=gen_kwargs.pop("budget", 64), **gen_kwargs)
    for p in prompts:
        gen.add_request(p, params)
    return count_steps(gen, steps)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 41))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


@pytest.mark.parametrize("budget", [64, 8], ids=["prefill_then_decode", "chunked_mixed"])
def test_syncs_and_copies_do_not_grow_with_layers(budget):
    """Prefill, chunked prefill mixed with decodes, then pure decode steps: every step's counts
    are the same with 6 layers as with 2."""
    two = run_counts(2, PROMPTS, GREEDY, 6, budget=budget)
    six = run_counts(6, PROMPTS, GREEDY, 6, budget=budget)
    for step, (a, b) in enumerate(zip(two, six)):
        assert a == b, f"step {step}: 2 layers {dict(a)} vs 6 layers {dict(b)}"
    # the counter does see a step's syncs (the sampler reads the sampled tokens back)
    assert sum(two[-1].values()) > 0


def test_the_one_copy_gives_back_every_parts_values_and_dtype():
    """The accelerator's path packs int64, int32 and float64 parts (a drawn step's temperatures and
    uniforms, as their bits) into one int64 buffer: run on CPU, each view must be its part exactly."""
    import numpy as np

    from nopad.inference.step_inputs import one_copy

    rng = np.random.default_rng(0)
    parts = [
        rng.integers(-(2**40), 2**40, size=7),
        rng.integers(-(2**31), 2**31 - 1, size=(2, 5)).astype(np.int32),
        np.array([0.0, 0.7, 1.0 - 2.0**-40, 1.3, 5e-324]),
        rng.integers(0, 9, size=(3, 4)),
    ]
    views = one_copy(parts, torch.device("cpu"))
    for part, view in zip(parts, views):
        assert view.dtype == torch.from_numpy(part).dtype and view.shape == part.shape
        assert np.array_equal(view.numpy(), part)


def test_step_tensors_take_one_host_to_device_copy(monkeypatch):
    """``build_step`` (and ``decode_step``, from a steady batch's kept arrays) packs ids, positions,
    boundaries, slots, block table and kept rows into one host buffer and moves it with one copy
    (seen on the ``meta`` device, where copies are real ops); nothing is built from Python lists on
    the device."""
    seen, kept = [], []
    run = ModelRunner.run

    def checked_run(self, plan, ids_from=None, rows=None, draw=None):
        meta_ids = None if ids_from is None else DeviceIds(ids_from.tokens.to("meta"), ids_from.rows)  # (overlap)
        mode = StepOps()
        with mode:
            if rows is None:
                step = build_step(plan, self.kv_cache.block_size, torch.device("meta"), meta_ids)
            else:
                step = decode_step(rows, self.kv_cache.block_size, torch.device("meta"))
                kept.append(step)
        assert step.input_ids.device.type == "meta" and step.meta.block_table.device.type == "meta"
        seen.append(mode.counts)
        if ids_from is None:  # the device path's tensors have the CPU path's dtypes and shapes (int32 boundaries)
            bs = self.kv_cache.block_size
            on_cpu = build_step(plan, bs, "cpu") if rows is None else decode_step(rows, bs, "cpu")
            for name, t in vars(on_cpu.meta).items():
                if isinstance(t, torch.Tensor):
                    other = getattr(step.meta, name)
                    assert (other.dtype, other.shape) == (t.dtype, t.shape), name
        return run(self, plan, ids_from, rows, draw)

    monkeypatch.setattr(ModelRunner, "run", checked_run)
    gen = Generator(tiny_model("llama"), block_size=4, max_num_batched_tokens=8)
    gen.generate(PROMPTS, GREEDY)
    assert len(seen) > 5 and kept  # the batch kept its arrays for some decode steps
    for counts in seen:
        assert counts["host_to_device"] == 1, dict(counts)
        assert counts["lift_fresh"] == 0, dict(counts)


@pytest.mark.parametrize("backend", ["sdpa_loop", "sdpa_dense", "sdpa_padded"])
def test_no_per_layer_syncs_on_other_backends(backend):
    """The gather paths (flash-attn's fallback, dense, padded) build their key index once per step."""
    two = run_counts(2, PROMPTS, GREEDY, 4, budget=8, attn_backend=backend)
    six = run_counts(6, PROMPTS, GREEDY, 4, budget=8, attn_backend=backend)
    assert two == six


def generate_tokens(family: str = "llama", **kwargs) -> list[list[int]]:
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    gen = Generator(tiny_model(family), block_size=4, max_num_batched_tokens=16, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in gen.generate(PROMPTS[:2] + [[3, 4]], params)]
    static = kwargs.get("static_decode") or kwargs.get("compile_decode")
    assert (gen._runner.static_steps > 0) == bool(static)  # the padded path did run
    if kwargs.get("compile_decode"):  # one compilation for every bucket
        graphs = counters["stats"]["unique_graphs"] - graphs_before
        assert graphs == 1 < len(gen._runner.static_shapes) < gen._runner.static_steps
    return tokens


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_static_decode_gives_the_same_greedy_tokens(family):
    """Padded, bucketed decode steps (scratch-block padding rows) pick the default path's tokens,
    also past a sliding window (Mistral, 8 tokens) and with soft-capping (Gemma2)."""
    assert generate_tokens(family, static_decode=True) == generate_tokens(family)


def test_static_decode_stays_off_in_batch_invariant_mode():
    """Batch-invariant mode needs the fixed-order kernel: its decode steps are not padded."""
    from nopad.packing import batch_invariant

    gen = Generator(tiny_model("llama"), block_size=4, static_decode=True)
    with batch_invariant():
        gen.generate(PROMPTS[:2], GREEDY)
    assert gen._runner.static_steps == 0


@pytest.mark.slow  # ~45 s: one cold inductor compilation (dynamic shapes) on a shared CPU
def test_compiled_static_decode_gives_the_same_greedy_tokens():
    """The decode forward under torch.compile (what CUDA graphs capture) picks the same tokens."""
    torch._dynamo.reset()
    compiled = generate_tokens(compile_decode=True)
    torch._dynamo.reset()
    assert compiled == generate_tokens()


def test_compiled_decode_compiles_once_across_buckets_and_generators(monkeypatch):
    """compile_decode compiled one graph per (rows, table width) bucket on CUDA, so a table crossing
    a power of two, or a new Generator with more rows, recompiled the model inside a run: on an
    H200, 1.2 s per decode step at 128 rows after a 64-row Generator. On every device a bucket of
    1 row or 1 block compiled again (dynamo specializes a size of 1). One compilation (rows and
    width dynamic, the same settings on every device) must serve every bucket and Generator.
    Dynamo's eager backend: the guards that decide a recompilation are dynamo's."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: compile_(model, backend="eager", **kw))
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    model, shapes = tiny_model("llama"), set()
    for num in (3, 9):  # 4 then 16 rows, down to the last one alone; blocks of 4: 1 block, then up to 6
        gen = Generator(model, block_size=4, max_num_batched_tokens=64, compile_decode=True)
        params = [SamplingParams(temperature=0.0, max_tokens=14 + i, ignore_eos=True) for i in range(num)]
        gen.generate([[5 + i] * 2 for i in range(num)], params)
        shapes |= gen._runner.static_shapes
    assert {rows for rows, _ in shapes} == {2, 4, 8, 16} and {width for _, width in shapes} == {2, 4, 8}
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_static_decode_runs_the_generators_attn_backend(monkeypatch):
    """The padded decode steps used to ignore ``attn_backend`` (they ran "auto" whatever was asked)."""
    import dataclasses

    from nopad.packing.attention.registry import backends

    kernel = backends()["kernel"]
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return kernel.static_decode(*args)

    spy_backend = dataclasses.replace(kernel, name="kernel_spy", static_decode=spy)
    monkeypatch.setitem(backends(), "kernel_spy", spy_backend)
    spied = generate_tokens("llama", static_decode=True, attn_backend="kernel_spy")
    assert calls and spied == generate_tokens("llama", static_decode=True)
    with pytest.raises(
        ValueError,
        match="attn_backend='sdpa_loop' has no static-shape decode path, "
        r"which static_decode=True \(and compile_decode\) runs; use one ",
    ):
        Generator(tiny_model("llama"), block_size=4, static_decode=True, attn_backend="sdpa_loop")


class LayerCalls:
    """Python function calls made inside each call of nopad's attention function (one per layer)."""

    def __init__(self, monkeypatch):
        import transformers

        from nopad.packing.hf import attention

        self.per_layer: list[int] = []
        inner = attention.nopad_attention

        def counted(*args, **kwargs):
            calls = [0]

            def profile(frame, event, arg):
                calls[0] += event == "call"

            sys.setprofile(profile)
            try:
                return inner(*args, **kwargs)
            finally:
                sys.setprofile(None)
                self.per_layer.append(calls[0])

        monkeypatch.setattr(attention, "nopad_attention", counted)
        monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "nopad", counted)


@pytest.fixture
def triton_host_side(monkeypatch):
    """nopad's Triton path with the launch replaced: everything the host does per layer on CUDA
    (the backend choice, the K/V write, the launcher's argument preparation) runs on CPU for real,
    and the stand-in checks that what reaches the launch needs no cast or copy there."""
    from nopad.packing.attention import triton_kernel

    launches = []

    def launch(q, k, v, out, cu_q, keys, table, page, rows, max_q, **kwargs):
        for t in (cu_q, keys) + ((table,) if table is not None else ()):
            assert t.device == q.device and t.is_contiguous(), (t.device, t.stride())
        assert table is None or table.dtype in (torch.int32, torch.int64)
        launches.append(rows)
        return out.zero_()

    monkeypatch.setattr(triton_kernel, "_launch", launch)
    monkeypatch.setattr(triton_kernel, "interpreted", lambda: True)
    return launches


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static_decode"])
def test_triton_steps_have_no_per_layer_sync_cast_or_backend_choice(triton_host_side, monkeypatch, static):
    """The H200's eager decode step was host-bound (GPU idle 92%): nothing on the Triton path may
    sync, cast (`.to(int32)` of an int64 tensor: a kernel per layer) or choose a backend per layer.
    Every step's sync/copy counts and runs of ``registry.choose`` are the same with 6 layers as with
    2, and one launch runs per layer."""
    from nopad.packing.attention import registry

    choices = []
    choose = registry.choose
    monkeypatch.setattr(registry, "choose", lambda *a, **k: choices.append(1) or choose(*a, **k))
    counts, runs = {}, {}
    for layers in (2, 6):
        choices.clear()
        del triton_host_side[:]
        counts[layers] = run_counts(layers, PROMPTS, GREEDY, 5, budget=64, attn_backend="triton", static_decode=static)
        runs[layers] = len(choices)
        assert len(triton_host_side) == 5 * layers  # one launch per layer and step
    assert counts[2] == counts[6]
    assert runs[2] == runs[6] <= 5  # at most one decision per step (the plan's), never per layer


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static_decode"])
def test_decode_attention_python_calls_per_layer_stay_few(triton_host_side, monkeypatch, static):
    """The host work of nopad's attention per decode layer, in Python function calls (a count, not
    a time: noise-free). After the first layer of a step (which resolves the plan) every layer makes
    the same few calls; a per-layer backend choice, meta rebuild, module walk, string formatting or
    an eager static step through the custom op's dispatch (17 calls, ~40 us) coming back would raise
    it (``benchmarks/bench_decode_host.py`` times the same path)."""
    calls = LayerCalls(monkeypatch)
    gen = Generator(
        tiny_model("llama", num_hidden_layers=4), block_size=16, attn_backend="triton", static_decode=static
    )
    for p in PROMPTS:
        gen.add_request(p, GREEDY)
    gen.step()  # prefill
    calls.per_layer.clear()
    with gc_held():
        gen.step()
    first, rest = calls.per_layer[0], calls.per_layer[1:]
    assert len(rest) == 3 and len(set(rest)) == 1, calls.per_layer
    budget = LAYER_CALL_BUDGET[static]
    assert rest[0] <= budget, f"{rest[0]} Python calls per decode layer, over {budget}"
    assert first > rest[0]  # the counter sees the plan being made


# Python calls per row of a decode step, scheduler + runner + sampler + postprocess (the step's
# calls at 40 rows less those at 8, over 32): 3 eager and static at this commit, 22 eager before the
# per-row property walks were cut (greedy read three times a row, blocks_for twice, ...); putting
# back any one file's walks (sampler, model_runner or request) gave 5 to 7
ROW_CALL_BUDGET = 4


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static_decode"])
def test_decode_step_python_calls_per_row_stay_few(triton_host_side, static):
    """The host work of a decode step per row (sequence), in Python calls (noise-free): at 256 rows
    the scheduler's, runner's and sampler's bookkeeping was several times all the layers' attention
    calls together. A property read two or three times a row, or a generator resumed once a row,
    coming back raises the count past the budget."""
    model = tiny_model("llama", num_hidden_layers=2)
    calls = {}
    for rows in (8, 40):
        gen = Generator(model, block_size=16, attn_backend="triton", static_decode=static, max_num_seqs=rows)
        for i in range(rows):
            gen.add_request([3 + i % 50, 4, 5, 6, 7], GREEDY)
        gen.step()  # prefill
        with gen.live.attention():  # held across steps, as generate() holds it
            gen.step()
            calls[rows] = python_calls(gen.step)
    per_row = (calls[40] - calls[8]) / 32
    assert per_row <= ROW_CALL_BUDGET, f"{per_row:.1f} Python calls per decode row, over {ROW_CALL_BUDGET}"


def test_static_decode_inputs_are_the_per_row_construction():
    """``build_static_decode`` fills its arrays in one numpy pass (no assignment per row) and puts the
    context lengths and positions in its one copy (no ``+ 1`` / ``- 1`` launched outside the compiled
    forward): every tensor equals the plain per-row construction, padding rows and widths included."""
    from types import SimpleNamespace

    import numpy as np

    from nopad.inference.step_inputs import DecodeRows, build_static_decode
    from nopad.inference.step_plan import StepPlan

    rng = np.random.default_rng(0)
    block, scratch = 4, 99
    for num in (1, 3, 8, 9, 20):
        computed = rng.integers(0, 40, num)
        seqs = [
            SimpleNamespace(
                num_computed=int(n),
                token_ids=rng.integers(3, 500, n + 1).tolist(),
                block_table=rng.permutation(90)[: n // block + 1].tolist(),
                state_slot=None,
            )
            for n in computed
        ]
        plan = StepPlan(seqs=seqs, query_lens=[1] * num)
        step = build_static_decode(DecodeRows.of(plan), block, "cpu", scratch, 64, 64)
        rows, width = step.meta.block_table.shape
        assert rows == row_bucket(num) and width == max(2, 1 << int(computed.max() // block).bit_length())
        table = torch.full((rows, width), scratch)
        ids, pos = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
        for i, s in enumerate(seqs):
            table[i, : len(s.block_table)] = torch.tensor(s.block_table)
            ids[i], pos[i] = s.token_ids[s.num_computed], s.num_computed
        slots = table[torch.arange(rows), pos // block] * block + pos % block
        meta = step.meta
        assert torch.equal(meta.block_table, table) and torch.equal(step.input_ids, ids[None])
        assert torch.equal(step.position_ids, pos[None]) and torch.equal(meta.position_ids, pos)
        assert torch.equal(meta.context_lens, pos + 1) and torch.equal(meta.slot_mapping, slots)
        assert step.sampling_rows == list(range(num))


@pytest.mark.parametrize("temperature, readbacks", [(0.0, 2), (1.0, 3), (0.7, 4)])
def test_a_decode_step_reads_back_only_what_its_rows_need(temperature, readbacks):
    """Each ``tolist()`` of a device tensor is a sync and a copy on CUDA. A greedy step reads back its
    tokens and their log-probs only (their temperature log-probs are those same numbers and their
    sampling log-probs 0, said on the host: it read back a copy and a tensor of zeros, 4 in all);
    temperature 1 adds the sampling log-probs, another temperature its tempered log-probs."""
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=1)
    for static in (False, True):
        last = run_counts(2, PROMPTS, params, 4, static_decode=static)[-1]
        assert last["Tensor.tolist"] == readbacks, (static, dict(last))


def test_compiled_decode_marks_dynamic_dimensions_only_on_a_new_bucket(monkeypatch):
    """Dynamic-dimension marks matter only to the call that compiles; a bucket seen before compiles
    nothing (its guards accept unmarked tensors), and nine marks a step were ~40 Python calls outside
    the forward. Dynamo's eager backend: the marks and guards are dynamo's."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: compile_(model, backend="eager", **kw))
    marks = []
    mark = torch._dynamo.maybe_mark_dynamic
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, dim: marks.append(dim) or mark(t, dim))
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    gen = Generator(tiny_model("llama"), block_size=4, max_num_batched_tokens=64, compile_decode=True)
    for i in range(9):  # 16 rows down to 2, tables of 1 block up to 6: several buckets
        gen.add_request([5 + i] * 2, SamplingParams(temperature=0.0, max_tokens=14 + i, ignore_eos=True))
    per_step = []
    while gen.has_unfinished():
        del marks[:]
        buckets = len(gen._runner.static_shapes) if gen._runner else 0
        gen.step()
        per_step.append((len(gen._runner.static_shapes) > buckets, len(marks)))
    assert [n for _, n in per_step] == [9 if new else 0 for new, _ in per_step], per_step
    assert 1 < sum(new for new, _ in per_step) < gen._runner.static_steps  # new buckets, and seen ones
    assert counters["stats"]["unique_graphs"] - graphs == 1


# Python calls a compiled decode step adds per layer (dynamo's eager backend: its guards and graph
# are dynamo's, without inductor's minutes of compiling): the attention op's OpOverload.__call__ and
# its CPU implementation, and F.silu, a Python function the eager backend calls (inductor fuses it).
# 18 a layer while the op was a torch.library.custom_op, whose Python wrappers run on every call.
COMPILED_LAYER_CALL_BUDGET = 3


def compiled_step_calls(layers: int, rows: int) -> int:
    """Python calls of one compiled decode step (attention held, as generate() holds it)."""
    gen = Generator(
        tiny_model("llama", num_hidden_layers=layers), block_size=16, max_num_seqs=rows, compile_decode=True
    )
    for i in range(rows):
        gen.add_request([3 + i % 50, 4, 5, 6, 7], GREEDY)
    gen.step()  # prefill
    with gen.live.attention():
        gen.step()
        gen.step()
        return python_calls(gen.step)


def test_compiled_decode_step_python_calls_do_not_grow_with_layers(monkeypatch):
    """A compiled decode step ran 17 Python calls per layer outside its graph (the attention custom
    op's wrappers), so on a GPU the host still paid per layer for a compiled forward. Counted, not
    timed; calls per added row stay within ROW_CALL_BUDGET on the compiled path too."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: compile_(model, backend="eager", **kw))
    torch._dynamo.reset()
    two, eight = compiled_step_calls(2, 8), compiled_step_calls(8, 8)
    per_layer = (eight - two) / 6
    assert per_layer <= COMPILED_LAYER_CALL_BUDGET, f"{per_layer:.1f} Python calls per compiled layer ({two}, {eight})"
    wide = compiled_step_calls(2, 40)
    per_row = (wide - two) / 32
    assert per_row <= ROW_CALL_BUDGET, f"{per_row:.1f} Python calls per compiled decode row"


def test_a_bare_step_switches_attention_in_calls_that_do_not_grow_with_layers():
    """A bare ``step()`` (``stream()``, a caller's own loop) switches the model to nopad attention and
    back; transformers' ``set_attn_implementation`` walks every module each way, ~200 Python calls
    per layer of every step. Only the first switch may walk: a bare step's calls grow with the
    layers exactly as a step's inside ``generate()`` (attention held across steps) do."""

    def calls(layers: int, held: bool) -> int:
        gen = Generator(tiny_model("llama", num_hidden_layers=layers), block_size=16, max_num_seqs=4)
        for p in PROMPTS:
            gen.add_request(p, GREEDY)
        gen.step()  # prefill
        gen.step()  # the first bare step: transformers' switch, each way, once
        with gen.live.attention() if held else contextlib.nullcontext():
            return python_calls(gen.step)

    calls(2, False), calls(2, True)  # first-call caches (imports, lazy lookups) out of the counts
    bare, held = (calls(6, h) - calls(2, h) for h in (False, True))
    assert bare == held, f"a bare step's Python calls grow by {(bare - held) / 4:.0f} a layer more"


def test_decode_forward_launches_without_syncs(triton_host_side, monkeypatch):
    """The step-loop design (docs/step-loop-design.md): between launching step N and step N+1 the
    only sync is the completion's read-back of sampled tokens. The static decode forward (what
    compile_decode compiles and CUDA graphs capture), on the Triton path whose launch is stubbed,
    forces no sync and reads nothing back (transformers' mask builder looked for packed sequences
    in the positions with a host read, once a forward); the whole step reads back only its tokens
    and log-probs."""
    gen = Generator(tiny_model("llama", num_hidden_layers=4), block_size=16, attn_backend="triton", static_decode=True)
    for p in PROMPTS:
        gen.add_request(p, GREEDY)
    gen.step()  # prefill
    inside: list[Counter] = []
    forward = gen._runner.model.forward

    def counted(*args, **kwargs):
        mode = StepOps()
        with mode, ReadBacks(mode.counts):
            out = forward(*args, **kwargs)
        inside.append(mode.counts)
        return out

    monkeypatch.setattr(gen._runner.model, "forward", counted)
    step = count_steps(gen, 3)
    assert gen._runner.static_steps == 3 and len(inside) == 3
    for counts in inside:
        syncs = {k: n for k, n in counts.items() if k in SYNC_OPS or k.startswith(("Tensor.", "repeat"))}
        assert not syncs, dict(counts)
    # tokens and log-probs, at completion: overlapped, a step completes the one before it
    assert [c["Tensor.tolist"] for c in step] == ([0, 2, 2] if gen.overlap else [2, 2, 2])
