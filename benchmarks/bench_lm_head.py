"""The LM head's memory and time on large vocabularies: one packed row's SFT loss,
forward and backward, by five methods side by side, each in a fresh process.

- ``hf_labels``: the model's own ``model(..., labels=...)`` (every position's logits);
- ``nopad_logits``: nopad's path before the chunked head (``row_loss_sum`` on every position's logits);
- ``trl_chunked_nll``: TRL's SFT loss (``loss_type="chunked_nll"``, now ``"nll"``: ``add_fused_lm_head``);
- ``torch_lce``: torch's ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions()``, where present;
- ``nopad_head``: ``nopad.training.loss.row_nll_sum`` (``nopad.packing.head.chunked.nll_sum``: loss positions only,
  chunked; the plain head's gradients taken in the forward, ``nopad.packing.head.linear``);
- ``nopad_head_autograd``: the same chunks through autograd, each checkpointed and recomputed in
  backward (``nopad.packing.head.chunked.head_logprobs`` with the head module's hooks, the path a LoRA head
  takes; the plain head's path before ``nopad.packing.head.linear``).

Workload: a random-weight Llama with a real vocabulary (151,936: Qwen3; 248,320: Qwen3.5) and a
small backbone (hidden 256, 2 layers, tied embeddings) so that the head dominates; one packed row of
``T`` tokens (sequences of 512, each sequence's first token unlabelled); fp32 and bf16 weights.

Memory, per method, in its own process: the process's peak RSS (``resource.getrusage`` ``ru_maxrss``)
after the method's forward and backward minus the peak after a backbone-only forward and backward
on the same row (its activations, and every parameter's ``.grad``, the tied embedding's included,
held from the warm-up). glibc is told to return every allocation over 64 KiB to the OS on free
(``MALLOC_MMAP_THRESHOLD_``), so RSS follows live memory. Measured twice, each in a fresh process:

- ``extra held``: the ``.grad`` tensors kept (``zero_grad(set_to_none=False)``; a gradient
  accumulation's second and later micro-batches). Every method's backward returns the head weight's
  gradient as one more ``V x H`` tensor that autograd then adds into ``.grad``, so this counts the
  head weight's gradient once more for every method (HF's included), where that tensor is alive at
  the method's peak (``V x H`` fp32: 148 MiB at a 151,936 vocabulary and hidden 256, which is
  exactly the goal at 2,048 tokens, ``T = 8 H``);
- ``extra none``: the ``.grad`` tensors freed before the method's pass (``zero_grad()``'s and
  ``optimizer.zero_grad()``'s default; a first micro-batch): the returned gradient becomes
  ``.grad`` itself, so this is the extra beyond the model's own gradients, which the baseline holds.

``/(TxV/8)`` is each against the goal: 1/8 of one fp32 ``T x V`` tensor (``--grads``: which to
run; ``-``: not run). Time (the first ``--grads`` mode's run), wall and CPU seconds (the process's,
all threads: the fairer ratio on a loaded machine):
the method's one forward and backward, after a warm-up of the method on a 64-token
row (first-call costs) and the backbone pass. Agreement: the loss's relative difference from
``hf_labels``'s (all processes build the same weights from one seed), and the relative difference
of the embedding's gradient norm. A method whose estimated need is over ``--max-gib`` is skipped and says so.

    python benchmarks/bench_lm_head.py                     # the table in docs/benchmarks.md
    python benchmarks/bench_lm_head.py --tokens 2048 --vocab 151936 --dtypes fp32
    python benchmarks/bench_lm_head.py --quick             # a 4,096-word vocabulary, 256 tokens
    python benchmarks/bench_lm_head.py --gemms --vocab 151936  # one chunk's GEMMs alone, fp32 beside bf16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere
METHODS = ("hf_labels", "nopad_logits", "trl_chunked_nll", "torch_lce", "nopad_head", "nopad_head_autograd")
FULL_LOGITS = {"hf_labels": 4, "nopad_logits": 4}  # fp32 T x V copies they hold at their peak (estimate)
SEQ_LEN = 512


def build(vocab: int, tokens: int, dtype: str):
    import torch
    import transformers

    from nopad.packing.hf import register_nopad_attention

    register_nopad_attention()
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(tokens, SEQ_LEN),
        tie_word_embeddings=True,
    )
    config._attn_implementation = "nopad"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    model.train()
    return model, packed_row(vocab, tokens)


def packed_row(vocab: int, tokens: int):
    """``tokens`` random tokens as sequences of :data:`SEQ_LEN`, each one's first token unlabelled."""
    import torch

    from nopad.packing.row import IGNORE_INDEX, PackedRow
    from nopad.packing.varlen import VarlenMeta

    lengths = [SEQ_LEN] * (tokens // SEQ_LEN) + ([tokens % SEQ_LEN] if tokens % SEQ_LEN else [])
    ids = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[torch.tensor([0] + lengths[:-1]).cumsum(0)] = IGNORE_INDEX
    return PackedRow.build(ids, labels, VarlenMeta.from_lengths(lengths))


def method_loss(name: str, model, row):
    """A function giving the row's mean next-token loss by method ``name`` (differentiable); its
    imports and setup happen here, before anything is measured."""
    import torch

    from nopad.training.loss import row_loss_sum, row_nll_sum

    n = row.num_loss_tokens
    if name == "hf_labels":
        return lambda: model(**row.model_kwargs(labels=True), use_cache=False).loss
    if name == "nopad_logits":
        return lambda: row_loss_sum(model(**row.model_kwargs(), use_cache=False).logits, row) / n
    if name == "nopad_head":
        return lambda: row_nll_sum(model, row) / n
    if name == "nopad_head_autograd":
        from nopad.packing.head.chunked import head_logprobs
        from nopad.packing.head.model_head import head_of

        predict_at, targets = row.loss_tokens()

        def autograd_head():
            hidden = model.model(**row.model_kwargs(), use_cache=False).last_hidden_state[0]
            return -head_logprobs(head_of(model), hidden[predict_at], targets)[0].sum() / n

        return autograd_head
    if name == "trl_chunked_nll":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
        return lambda: model(**row.model_kwargs(labels=True), fused_lm_head=True).loss
    if name == "torch_lce":
        from torch.nn import LinearCrossEntropyOptions

        predict_at, targets = row.loss_tokens()

        def lce():
            hidden = model.model(**row.model_kwargs(), use_cache=False).last_hidden_state[0]
            return (
                torch.nn.functional.linear_cross_entropy(
                    hidden[predict_at],
                    model.lm_head.weight,
                    targets,
                    reduction="sum",
                    options=LinearCrossEntropyOptions(),
                )
                / n
            )

        return lce
    raise ValueError(f"unknown method {name!r}; choose from {METHODS}")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_one(name: str, vocab: int, tokens: int, dtype: str, grads: str = "held") -> dict:
    """One method in this process: the backbone's pass, then the method's (with every ``.grad``
    kept, or freed first: ``grads`` "held" / "none"); what each cost."""
    import torch

    if name == "torch_lce" and not hasattr(torch.nn.functional, "linear_cross_entropy"):
        return {"skipped": f"torch {torch.__version__} has no linear_cross_entropy"}
    import trl.trainer.utils  # noqa: F401  (every method's process imports the same, before measuring)

    model, row = build(vocab, tokens, dtype)
    method_loss(name, model, packed_row(vocab, 64))().backward()  # warm-up: every first-call cost
    model.zero_grad(set_to_none=False)
    loss_fn = method_loss(name, model, row)
    t0 = time.perf_counter()
    hidden = model.model(**row.model_kwargs(), use_cache=False).last_hidden_state
    hidden.float().square().mean().backward()
    backbone_s = time.perf_counter() - t0
    base = peak_rss()  # with every .grad held
    model.zero_grad(set_to_none=grads == "none")
    t0, c0 = time.perf_counter(), time.process_time()
    loss = loss_fn()
    loss.backward()
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    grad = model.get_input_embeddings().weight.grad.float().norm()
    return {
        "extra_bytes": peak_rss() - base,
        "seconds": seconds,
        "cpu_s": cpu_s,
        "backbone_s": backbone_s,
        "loss": float(loss),
        "grad_norm": float(grad),
        "base_bytes": base,
    }


def child(name: str, vocab: int, tokens: int, dtype: str, grads: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, __file__, "--one", name, str(vocab), str(tokens), dtype, grads]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"skipped": f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimate_gib(name: str, vocab: int, tokens: int) -> float:
    return FULL_LOGITS.get(name, 0.5) * tokens * vocab * 4 / 2**30


def measure(args, name: str, vocab: int, tokens: int, dtype: str) -> dict:
    """The method's row: its ``held`` run, with the ``none`` run's extra memory beside it."""
    need = estimate_gib(name, vocab, tokens)
    if need > args.max_gib:
        r = {"skipped": f"needs ~{need:.0f} GiB > --max-gib {args.max_gib:g}"}
    else:  # --quick: one process for all (a smoke run; its memory columns are not a measure)
        run = run_one if args.quick else child
        r = run(name, vocab, tokens, dtype, args.grads[0])
        r["extra_bytes_grad_" + args.grads[0]] = r.get("extra_bytes")
        for grads in args.grads[1:]:
            if "skipped" not in r:
                r["extra_bytes_grad_" + grads] = run(name, vocab, tokens, dtype, grads).get("extra_bytes")
    r.update(method=name, vocab=vocab, tokens=tokens, dtype=dtype)
    return r


def table_cells(r: dict, ref: dict | None, goal: float) -> str:
    """Extra memory held / none against the goal, time, and agreement with ``ref`` (HF's)."""
    cells = []
    for grads in ("held", "none"):
        extra = r.get("extra_bytes_grad_" + grads)
        cells.append(f"{extra / 2**20:10.0f} {extra / goal:8.2f}" if extra is not None else f"{'-':>10} {'-':>8}")
    x_hf, x_cpu, loss_d, grad_d = "    -", "    -", f"{'-':>13}", f"{'-':>13}"
    if ref:
        x_hf, x_cpu = f"{r['seconds'] / ref['seconds']:5.2f}", f"{r['cpu_s'] / ref['cpu_s']:5.2f}"
        loss_d = f"{abs(r['loss'] - ref['loss']) / abs(ref['loss']):13.1e}"
        grad_d = f"{abs(r['grad_norm'] - ref['grad_norm']) / ref['grad_norm']:13.1e}"
    return f"{' '.join(cells)} {r['seconds']:7.2f} {x_hf} {r['cpu_s']:7.2f} {x_cpu} {loss_d} {grad_d}"


def chunk_gemms(vocab: int, hidden: int = 256, chunk: int = 128, repeats: int = 2) -> None:
    """One head chunk's GEMMs, fp32 beside bf16, each timed alone (wall seconds, best of
    ``repeats``): where a bf16 head's time goes on a CPU without native bf16 GEMMs, and what
    ``nopad.packing.head.linear`` runs there instead (the fp32 rows with an upcast)."""
    import torch

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    print(
        f"vocab {vocab}, hidden {hidden}, chunk {chunk}; oneDNN bf16 GEMMs: "
        f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for name, fn in _gemms(dtype, vocab, hidden, chunk).items():
            print(f"{str(dtype):>15} {name:>28} {best(fn):8.2f} s", flush=True)


def _gemms(dtype, vocab: int, hidden: int, chunk: int) -> dict:
    import torch

    w = torch.randn(vocab, hidden).to(dtype)
    h, g = torch.randn(chunk, hidden).to(dtype), (torch.randn(chunk, vocab) * 1e-3).to(dtype)
    acc = torch.zeros(vocab, hidden)
    rows = {"logits h @ W^T": lambda: h @ w.t(), "grad_h g @ W": lambda: g @ w, "grad_W g^T @ h": lambda: g.t() @ h}
    if dtype != torch.float32:
        rows["grad_h fp32 upcast"] = lambda: g.float() @ w.float()
        rows["grad_W fp32 upcast, addmm_"] = lambda: acc.addmm_(g.t().float(), h.float())
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a 4,096-word vocabulary, 256 tokens, fp32, every method in this one process "
        "(a smoke run: its memory columns are not a per-method measure)",
    )
    p.add_argument("--vocab", type=int, nargs="+", default=[151_936, 248_320])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument(
        "--grads",
        nargs="+",
        default=["held", "none"],
        choices=["held", "none"],
        help="the .grad modes to measure (time and agreement: the first one's run)",
    )
    p.add_argument("--max-gib", type=float, default=9.0, help="skip a method estimated to need more")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument(
        "--gemms",
        action="store_true",
        help="time one chunk's GEMMs alone, fp32 beside bf16, at the first --vocab (then exit)",
    )
    p.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gemms:
        return chunk_gemms(4096 if args.quick else args.vocab[0], repeats=1 if args.quick else 2)
    if args.one:
        name, vocab, tokens, dtype, grads = args.one
        print(json.dumps(run_one(name, int(vocab), int(tokens), dtype, grads)))
        return
    if args.quick:
        args.vocab, args.tokens, args.dtypes = [4096], [256], ["fp32"]
    rows = []
    print(
        f"{'vocab':>7} {'T':>6} {'dtype':>5} {'method':>19} {'extra held':>10} {'/(TxV/8)':>8} "
        f"{'extra none':>10} {'/(TxV/8)':>8} {'time s':>7} {'x hf':>5} {'cpu s':>7} {'x hf':>5} "
        f"{'loss rel diff':>13} {'grad rel diff':>13}   (extra: MiB)"
    )
    for vocab in args.vocab:
        for tokens in args.tokens:
            for dtype in args.dtypes:
                ref = None
                for name in args.methods:
                    r = measure(args, name, vocab, tokens, dtype)
                    rows.append(r)
                    if "skipped" in r:
                        print(f"{vocab:>7} {tokens:>6} {dtype:>5} {name:>19}  skipped: {r['skipped']}")
                        continue
                    ref = ref or (r if name == "hf_labels" else None)
                    cells = table_cells(r, ref, tokens * vocab * 4 / 8)
                    print(f"{vocab:>7} {tokens:>6} {dtype:>5} {name:>19} {cells}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
