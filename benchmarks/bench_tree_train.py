"""Training on trajectory trees: tree rows vs one-level shared-prefix rows vs flat packing.

Workload: branched agentic episodes. Each of ``--prompts`` prompts (a system prompt with tool
schemas and a task) runs ``--turns`` turns and forks ``--branching`` ways at every turn, so a prompt
has ``branching ** turns`` leaves. A turn is a model response (trained on) followed by a tool
result (not trained on; the last turn has none). Lengths are drawn from a mixture (printed with
the figures; fixed seed). Every leaf is one training path: its flat sequence is the prompt and the
turns on its branch.

Compared, forward + backward of the loss ``-sum(weight * logp)`` over every (path, model token)
pair (``nopad.training.grpo.packed_logprobs``, the weight as the row's token values), the LM head only on
the positions that predict those tokens, the best of ``--repeats``:

  tree    nopad.packing.bins.tree.pack_tree_rows (what nopad.training.grpo.pack_rollouts builds): every
          shared token once
  shared  one-level shared-prefix rows (VarlenMeta.shared_prefix, GRPO's packing before trees):
          each prompt once, each path's turns on their own
  flat    every path its own sequence, BFD-packed rows

Reported: rows, tokens computed, fill (tokens / rows x capacity), fwd+bwd wall and CPU seconds,
path tokens per CPU second (the flat sequences' tokens trained per second of work), its ratio to
flat packing, and each mode's loss's relative gap from flat packing's (one loss, three ways). Then
tree vs flat as a share of the redundancy, and of the work's ratio (estimated FLOPs, :func:`work`):
the LM head and attention shrink less than the tokens, so the redundancy is not reachable.

    python benchmarks/bench_tree_train.py            # a small Llama and SmolLM2-135M, fp32
    python benchmarks/bench_tree_train.py --quick    # a tiny Llama, 2 prompts, seconds
    python benchmarks/bench_tree_train.py --fork444  # 4 prompts x 4 x 4 paths, a ~20M Llama
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from nopad.packing.bins.binpack import pack  # noqa: E402
from nopad.packing.bins.tree import TreePath, pack_tree_rows, unique_tokens  # noqa: E402
from nopad.packing.hf import use_nopad_attention  # noqa: E402
from nopad.packing.row import IGNORE_INDEX, PackedRow  # noqa: E402
from nopad.packing.varlen import VarlenMeta  # noqa: E402
from nopad.training.grpo import packed_logprobs  # noqa: E402

# (share, lo, hi) components of each length's mixture
PROMPT = ((0.4, 200, 500), (0.6, 500, 1200))  # system prompt + tool schemas + task
RESPONSE = ((0.7, 20, 80), (0.3, 80, 300))  # a tool call, or reasoning then a call
TOOL = ((0.5, 10, 60), (0.5, 60, 300))  # a short status, or a page of results
PROMPT_SCALE_444 = 0.4  # --fork444's prompts: with lengths x0.25, 8,559 path tokens over 2,565 (3.34x)


def draw(rng, mixture, scale):
    shares = np.array([m[0] for m in mixture])
    lo, hi = mixture[rng.choice(len(mixture), p=shares / shares.sum())][1:]
    return max(1, int(rng.integers(lo, hi + 1) * scale))


def episodes(prompts, turns, branching, vocab, scale, seed=0, prompt_scale=1.0):
    """Paths of branched episodes: ``(prompt_len, TreePath)`` per leaf, with per-token weights."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        p = draw(rng, PROMPT, scale * prompt_scale)
        frontier = [(rng.integers(3, vocab, p).tolist(), [False] * p)]
        for turn in range(turns):
            grown = []
            for ids, mask in frontier:
                for _ in range(branching):
                    r = draw(rng, RESPONSE, scale)
                    t = draw(rng, TOOL, scale) if turn < turns - 1 else 0
                    new = rng.integers(3, vocab, r + t).tolist()
                    grown.append((ids + new, mask + [True] * r + [False] * t))
            frontier = grown
        for ids, mask in frontier:
            out.append((p, TreePath(ids, mask, {"advantages": rng.standard_normal(len(ids)).tolist()})))
    return out


def _labels(path):
    return [t if m else IGNORE_INDEX for t, m in zip(path.ids, path.loss_mask)]


def _weights(path, start=0):
    return [w for w, m in zip(path.extras["advantages"][start:], path.loss_mask[start:]) if m]


def flat_rows(paths, capacity):
    """Every path its own sequence, BFD-packed."""
    rows = []
    for bin_ in pack([len(p.ids) for p in paths], capacity):
        order = bin_.tolist()
        rows.append(
            PackedRow.build(
                [t for i in order for t in paths[i].ids],
                [t for i in order for t in _labels(paths[i])],
                VarlenMeta.from_lengths([len(paths[i].ids) for i in order]),
                token_values={"advantages": [w for i in order for w in _weights(paths[i])]},
            )
        )
    return rows


def shared_rows(episode_paths, capacity):
    """One-level shared prefix (what nopad packed GRPO groups as before trees): each prompt once per
    row, every path's turns a completion of their own reading it (``VarlenMeta.shared_prefix``); a
    group that does not fit a row is split, its prompt repeated (first fit, in order)."""
    members = {}
    for i, (p, path) in enumerate(episode_paths):
        members.setdefault(tuple(path.ids[:p]), []).append(i)
    pieces = []  # (prompt length, [path indices])
    for idx in members.values():
        p = episode_paths[idx[0]][0]
        parts, used = [], []
        for i in idx:
            n = len(episode_paths[i][1].ids) - p
            fit = next((k for k, u in enumerate(used) if u + n <= capacity), None)
            if fit is None:
                parts.append([i])
                used.append(p + n)
            else:
                parts[fit].append(i)
                used[fit] += n
        pieces += [(p, part) for part in parts]
    sizes = [p + sum(len(episode_paths[i][1].ids) - p for i in part) for p, part in pieces]
    rows = []
    for bin_ in pack(sizes, capacity):
        ids, labels, weights, groups = [], [], [], []
        for p, part in (pieces[k] for k in bin_.tolist()):
            first = episode_paths[part[0]][1]
            ids += list(first.ids[:p])
            labels += [IGNORE_INDEX] * p
            for i in part:
                path = episode_paths[i][1]
                ids += list(path.ids[p:])
                labels += _labels(path)[p:]
                weights += _weights(path, p)
            groups.append((p, [len(episode_paths[i][1].ids) - p for i in part]))
        rows.append(
            PackedRow.build(ids, labels, VarlenMeta.shared_prefix(groups), token_values={"advantages": weights})
        )
    return rows


def step(model, rows):
    """One forward + backward of the whole workload; returns the loss."""
    total = 0.0
    for row in rows:
        loss = -(packed_logprobs(model, row) * row.token_values["advantages"]).sum()
        loss.backward()
        total += float(loss.detach())
    return total


def work(model, rows):
    """Estimated fwd+bwd FLOPs of a step over ``rows`` and the three counts they grow with. Why:
    a tree shrinks only the backbone's matmuls by the redundancy (tokens computed). The LM head (4
    ``H x V`` GEMMs per position: forward, recompute, two gradients) shrinks by its positions, and
    attention by the (query, key) pairs, which a tree keeps: a shared prefix is every path's keys."""
    config = model.config
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
    body = sum(p.numel() for p in model.parameters() if p.dim() > 1 and id(p) not in embeddings)
    tokens = sum(r.num_tokens for r in rows)
    positions = sum(int(r.loss_tokens()[0].numel()) for r in rows)
    pairs = sum(
        lq * (lk - lq) + lq * (lq + 1) // 2
        for r in rows
        for lq, lk in zip(r.nopad_meta.seqlens_q, r.nopad_meta.seqlens_k)
    )
    attention = 12 * config.num_attention_heads * head_dim * config.num_hidden_layers  # QK, PV: x3 fwd+bwd
    flops = 6 * body * tokens + 8 * hidden * vocab * positions + attention * pairs
    return flops, tokens, positions, pairs


def best_time(model, rows, repeats):
    """``(wall s, CPU s, loss)`` of the best of ``repeats`` steps, after an untimed step on the
    first row (warm-up). CPU seconds (this process's, all threads) are the work done, what a
    machine shared with other jobs still measures; wall seconds are what a dedicated one shows."""
    step(model, rows[:1])
    best, loss = (float("inf"), float("inf")), None
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(model, rows)
        best = min(best, (time.perf_counter() - t0, time.process_time() - c0), key=lambda t: t[1])
    return *best, loss


def small_llama(quick, size="57m"):
    import transformers

    if size == "20m":  # a ~20M Llama-like model: the size a user's forked-rollout check trained
        shape = dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=32000,
        )
        config = transformers.LlamaConfig(**shape, max_position_embeddings=8192)
        torch.manual_seed(0)
        return "~20M Llama (256 x 8 layers, 32k vocab)", transformers.LlamaForCausalLM(config).float()
    if quick:
        shape = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
    else:
        shape = dict(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=32000,
        )
    config = transformers.LlamaConfig(**shape, max_position_embeddings=8192)
    torch.manual_seed(0)
    name = "tiny Llama" if quick else "small Llama (512 x 8 layers, 32k vocab)"
    return name, transformers.LlamaForCausalLM(config).float()


def smollm2():
    from nopad.assets.smollm2 import load_smollm2

    model, _ = load_smollm2(torch.float32)
    return "SmolLM2-135M", model


def run(name, model, args):
    model.train()
    vocab = model.config.vocab_size
    episode_paths = episodes(
        args.prompts, args.turns, args.branching, vocab, args.scale, prompt_scale=args.prompt_scale
    )
    paths = [p for _, p in episode_paths]
    flat_tokens = sum(len(p.ids) for p in paths)
    unique = unique_tokens(paths)
    longest = max(len(p.ids) for p in paths)
    capacity = max(args.capacity, longest)
    print(
        f"\n{name}: {args.prompts} prompts x {args.branching}^{args.turns} leaves = {len(paths)} paths, "
        f"longest {longest}, flat tokens {flat_tokens}, trie tokens {unique}, redundancy "
        f"{flat_tokens / unique:.2f}x, loss pairs {sum(int(np.sum(p.loss_mask)) for p in paths)}, row "
        f"capacity {capacity}, best of {args.repeats} after a one-row warm-up"
    )
    modes = {
        "tree": pack_tree_rows(paths, capacity),
        "shared": shared_rows(episode_paths, capacity),
        "flat": flat_rows(paths, capacity),
    }
    print(
        f"{'mode':>8} {'rows':>5} {'tokens':>8} {'fill':>6} {'wall s':>8} {'CPU s':>8} "
        f"{'path tok/CPU s':>15} {'vs flat':>8} {'loss gap':>9}"
    )
    results = {}
    with use_nopad_attention(model):
        for mode in ("flat", "shared", "tree"):
            results[mode] = (modes[mode], *best_time(model, modes[mode], args.repeats))
    flat_cpu, flat_loss = results["flat"][2], results["flat"][3]
    for mode in ("tree", "shared", "flat"):
        rows, wall, cpu, loss = results[mode]
        tokens = sum(r.num_tokens for r in rows)
        print(
            f"{mode:>8} {len(rows):5d} {tokens:8d} {tokens / (len(rows) * capacity):6.1%} {wall:8.2f} "
            f"{cpu:8.2f} {flat_tokens / cpu:15.0f} {flat_cpu / cpu:7.2f}x "
            f"{abs(loss - flat_loss) / abs(flat_loss):9.1e}",
            flush=True,
        )
    tree_speedup = flat_cpu / results["tree"][2]
    print(
        f"tree vs flat {tree_speedup:.2f}x at redundancy {flat_tokens / unique:.2f}x: "
        f"{tree_speedup / (flat_tokens / unique):.2f} of the redundancy",
        flush=True,
    )
    (tree_work, *tree_n), (flat_work, *flat_n) = (work(model, results[mode][0]) for mode in ("tree", "flat"))
    print(
        f"work (fwd+bwd FLOPs, estimated): tree {tree_work / 1e9:.3g} G, flat {flat_work / 1e9:.3g} G, "
        f"{flat_work / tree_work:.2f}x, what tree rows can gain here: only the backbone's "
        f"matmuls shrink by the tokens ({flat_n[0] / tree_n[0]:.2f}x); the LM head's by its positions "
        f"(tree {tree_n[1]}, flat {flat_n[1]}: {flat_n[1] / tree_n[1]:.2f}x) and attention's by the "
        f"(query, key) pairs ({flat_n[2] / tree_n[2]:.2f}x). Measured {tree_speedup:.2f}x: "
        f"{tree_speedup * tree_work / flat_work:.2f} of it",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, 2 prompts, lengths x0.1")
    parser.add_argument("--models", nargs="+", default=["llama", "smollm2"], choices=["llama", "llama20m", "smollm2"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--branching", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every drawn length")
    parser.add_argument("--prompt-scale", type=float, default=1.0, help="multiplies the prompts' lengths")
    parser.add_argument(
        "--fork444",
        action="store_true",
        help="a forked RL workload: 4 prompts x 4 x 4 paths (2 turns, 4 ways), "
        "redundancy ~3.3x, a ~20M Llama, 1 thread",
    )
    parser.add_argument("--capacity", type=int, default=8192, help="tokens per row (>= the longest path)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if args.quick:
        args.models, args.prompts, args.scale, args.capacity = ["llama"], 2, 0.1, 512
    if args.fork444:
        args.models, args.prompts, args.turns, args.branching = ["llama20m"], 4, 2, 4
        args.scale, args.prompt_scale, args.capacity, args.threads = 0.25, PROMPT_SCALE_444, 1024, 1
    torch.set_num_threads(args.threads)
    print(
        f"fp32 on {args.threads} CPU thread(s); lengths drawn (x{args.scale}) from prompt {PROMPT}, "
        f"response {RESPONSE}, tool result {TOOL} as (share, lo, hi)"
    )
    for model_name in args.models:
        if model_name == "smollm2":
            name, model = smollm2()
        else:
            name, model = small_llama(args.quick, "20m" if model_name == "llama20m" else "57m")
        run(name, model, args)


if __name__ == "__main__":
    main()
