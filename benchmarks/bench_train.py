"""Training throughput: padding vs transformers' flattening vs nopad packing, same model, same data.

A small Llama (4 layers, hidden 256, 8 heads, 2 KV heads) on CPU in fp32; forward + backward real
(non-padding) tokens per second over the same lognormal-length sequences (median 350, capped to
2048), with the same token budget per step for every system:

  (a) padded   micro-batches of B sequences padded to their longest (what
               DataCollatorWithPadding gives), sdpa; B = budget / mean length, so a step holds
               ``budget`` real tokens on average
  (b) flatten  transformers.DataCollatorWithFlattening (one row, position_ids), sdpa,
               use_cache=False; sequences in the same order, up to ``budget`` tokens per row
  (c) nopad    nopad.packing.pack BFD bins of ``budget`` tokens, attn_implementation="nopad" with the
               row's VarlenMeta

    python benchmarks/bench_train.py            # full run
    python benchmarks/bench_train.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers

from nopad.packing import VarlenMeta, pack
from nopad.packing.hf import register_nopad_attention


def make_lengths(n: int, cap: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(350), 0.9, n).astype(int), 2, cap)


def make_model(vocab: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float().train()


def padded_batches(seqs, budget):
    """Fixed micro-batches of B consecutive sequences (B = budget / mean length), padded to the
    longest: the usual DataLoader(batch_size=B, collate_fn=DataCollatorWithPadding) setup."""
    per_batch = max(1, round(budget / np.mean([len(s) for s in seqs])))
    batches = [seqs[i : i + per_batch] for i in range(0, len(seqs), per_batch)]
    out = []
    for b in batches:
        width = max(len(s) for s in b)
        ids = torch.zeros(len(b), width, dtype=torch.long)
        mask = torch.zeros(len(b), width, dtype=torch.long)
        for i, s in enumerate(b):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False))
    return out


def flattened_batches(seqs, budget):
    """transformers' DataCollatorWithFlattening over consecutive sequences up to the budget."""
    collator = transformers.DataCollatorWithFlattening(return_tensors="pt")
    batches, cur, used = [], [], 0
    for s in seqs:
        if cur and used + len(s) > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += len(s)
    batches.append(cur)
    out = []
    for b in batches:
        batch = collator([{"input_ids": s.tolist()} for s in b])
        out.append(
            dict(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                labels=batch["labels"],
                use_cache=False,
            )
        )
    return out


def nopad_batches(seqs, budget):
    """BFD bins from nopad.packing.pack, one packed row each, with the row's VarlenMeta."""
    bins = pack([len(s) for s in seqs], budget, strategy="bfd")
    out = []
    for b in range(len(bins.offsets) - 1):
        members = [seqs[i] for i in bins.indices[bins.offsets[b] : bins.offsets[b + 1]]]
        meta = VarlenMeta.from_lengths([len(s) for s in members])
        ids = torch.cat(members)[None]
        labels = ids.clone()
        labels[0, meta.cu_seqlens_q[:-1].long()] = -100  # no prediction across a boundary
        out.append(
            dict(input_ids=ids, position_ids=meta.position_ids[None], labels=labels, nopad_meta=meta, use_cache=False)
        )
    return out


def run(model, impl: str, batches, real_tokens: int) -> dict:
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    model(**batches[0]).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    computed = 0
    for batch in batches:
        model(**batch).loss.backward()
        computed += batch["input_ids"].numel()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return dict(seconds=elapsed, tok_s=real_tokens / elapsed, steps=len(batches), efficiency=real_tokens / computed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 sequences, 1024 tokens per step")
    parser.add_argument("--sequences", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None, help="tokens per step (default 4096)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.sequences or (6 if args.quick else 48)
    budget = args.budget or (1024 if args.quick else 4096)
    cap = min(2048, budget)
    vocab = 2048  # a small head, so the layers (and attention) carry most of the compute
    lengths = make_lengths(n, cap, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(3, vocab, (int(x),), generator=g) for x in lengths]
    real = int(lengths.sum())
    register_nopad_attention()
    model = make_model(vocab)
    print(
        f"{n} sequences, {real} tokens (median {int(np.median(lengths))}, max {lengths.max()}), "
        f"budget {budget} tokens/step, {args.threads} threads"
    )
    systems = [
        ("(a) padded, sdpa", "sdpa", padded_batches(seqs, budget)),
        ("(b) DataCollatorWithFlattening, sdpa", "sdpa", flattened_batches(seqs, budget)),
        ("(c) nopad packed (BFD), nopad attention", "nopad", nopad_batches(seqs, budget)),
    ]
    results = {}
    for name, impl, batches in systems:
        results[name] = run(model, impl, batches, real)
    base_a, base_b = (results[systems[0][0]]["tok_s"], results[systems[1][0]]["tok_s"])
    print(
        f"{'system':42s} {'steps':>5s} {'tokens eff':>10s} {'seconds':>8s} {'tok/s':>8s} {'vs (a)':>7s} {'vs (b)':>7s}"
    )
    for name, r in results.items():
        print(
            f"{name:42s} {r['steps']:5d} {r['efficiency']:10.1%} {r['seconds']:8.2f} {r['tok_s']:8.0f} "
            f"{r['tok_s'] / base_a:6.2f}x {r['tok_s'] / base_b:6.2f}x"
        )


if __name__ == "__main__":
    main()
