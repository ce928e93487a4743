"""Rollouts on a DeepSpeed ZeRO-3 model, 2 CPU ranks over gloo, ranks of very different output
lengths (rank 0: 8 new tokens per prompt, rank 1: 8 x longer): peak memory per rank and time of

  - nopad gather-once  (full weights gathered once per rollout, hooks detached, ranks independent)
  - nopad lockstep     (weights stay sharded; ranks step together, dummy forwards when done)
  - HF ``generate(synced_gpus=True)``  (transformers' lockstep, the peer), static left-padded batch

each measured in its own 2-process launch (RSS never shrinks back, so regimes cannot share a
process); ``--quick`` runs the three in turn in one launch, whose start-up (torchrun, DeepSpeed's
imports and process group) is most of a smoke run's time: its memory columns are then not comparable.
Peak memory is the rank's resident set sampled every millisecond during the rollout,
minus the resident set just before it: what the rollout regime itself costs. Greedy, ignore_eos:
every system makes the same tokens.

    python benchmarks/bench_sharded.py            # hidden 768, 8 layers (~58 M parameters)
    python benchmarks/bench_sharded.py --quick    # hidden 128, 2 layers (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere

REGIMES = ("gather", "lockstep", "hf_synced_gpus")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest resident set size seen by a 1 ms polling thread inside the ``with`` block."""

    def __enter__(self):
        self.base = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())
        return False


class LiveParams:
    """Peak bytes of gathered (full, un-partitioned) ZeRO-3 parameters, probed at the start of
    every submodule's forward: what a rollout regime holds of the weights at once."""

    def __init__(self, model):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = list(model.parameters())
        self.peak = 0

        def probe(*_):
            available = ZeroParamStatus.AVAILABLE
            held = sum(p.ds_numel * p.element_size() for p in params if p.ds_status == available)
            self.peak = max(self.peak, held)

        self.handles = [m.register_forward_pre_hook(probe) for m in model.modules()]

    def remove(self):
        for h in self.handles:
            h.remove()


def worker(regimes: list[str], quick: bool, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for regime in regimes:
        run_regime(regime, quick, out_dir)
    dist.destroy_process_group()


def run_regime(regime: str, quick: bool, out_dir: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers

    from nopad.inference import Generator, SamplingParams
    from nopad.inference.sharded import sharded_generate

    rank = dist.get_rank()
    hidden, layers = (128, 2) if quick else (768, 8)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    num_params = sum(p.numel() for p in model.parameters())
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "zero_allow_untested_optimizer": True,
            # keep ~one layer live and prefetched, as a model too big for one device would be run
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_max_live_parameters": layer_params,
                "stage3_prefetch_bucket_size": layer_params,
                "stage3_max_reuse_distance": 0,
            },
            "steps_per_print": 10**9,
        },
    )
    policy = engine.module
    g = torch.Generator().manual_seed(rank)
    num_prompts = 4 if quick else 8
    prompts = [
        torch.randint(3, 4096, (int(n),), generator=g).tolist()
        for n in torch.randint(16, 48, (num_prompts,), generator=g)
    ]
    new_tokens = 8 if rank == 0 else (32 if quick else 64)
    live = LiveParams(policy)
    dist.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        if regime == "hf_synced_gpus":
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            pads = torch.tensor([width - len(p) for p in prompts])
            mask = (torch.arange(width)[None] >= pads[:, None]).long()
            with torch.no_grad():
                out = policy.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    synced_gpus=True,
                    pad_token_id=0,
                )
            tokens = [row[width:].tolist() for row in out]
        else:
            blocks = sum(-(-(len(p) + new_tokens) // 16) for p in prompts)  # the KV cache the rollout needs
            gen = Generator(policy, num_blocks=blocks, max_num_batched_tokens=512)
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            outs = sharded_generate(gen, engine, prompts, params, mode=regime)
            gen.release()
            tokens = [o.outputs[0].token_ids for o in outs]
        seconds = time.perf_counter() - t0
    dist.barrier()
    live.remove()
    result = {
        "regime": regime,
        "rank": rank,
        "seconds": seconds,
        "peak_bytes": mem.peak - mem.base,
        "peak_live_param_bytes": live.peak,
        "new_tokens": sum(map(len, tokens)),
        "num_params": num_params,
        "tokens": tokens,
    }
    Path(out_dir, f"{regime}_rank{rank}.json").write_text(json.dumps(result))


def launch(regimes: list[str], quick: bool, out_dir: str) -> dict[str, list[dict]]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(ROOT),
        # blocks >= 64 KiB are mmapped and unmapped when freed, so RSS follows live memory instead
        # of glibc's retained heap (which would keep every freed ZeRO-3 gather buffer)
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    # --standalone: the rendezvous binds a free port itself, per launch (a fixed --master_port can be
    # held by another process, or by the previous regime's launch still in TIME_WAIT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        "--worker",
        ",".join(regimes),
        "--out",
        out_dir,
    ] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        # a rank's traceback comes before torchrun's failure report: keep enough of the tail for both
        raise RuntimeError(
            f"the {'/'.join(regimes)} launch failed (exit {proc.returncode}); the end of its "
            f"stderr:\n{proc.stderr[-6000:]}"
        )
    return {
        regime: [json.loads(Path(out_dir, f"{regime}_rank{r}.json").read_text()) for r in range(2)]
        for regime in regimes
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # comma-separated regimes, run in turn
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker.split(","), args.quick, args.out)
    with tempfile.TemporaryDirectory() as out:
        if args.quick:
            runs = launch(list(REGIMES), args.quick, out)
        else:
            runs = {regime: launch([regime], args.quick, out)[regime] for regime in REGIMES}
    params = runs["gather"][0]["num_params"]
    print(
        f"ZeRO-3, 2 CPU ranks (gloo), Llama {params / 1e6:.1f} M parameters "
        f"({params * 4 / 2**20:.0f} MiB fp32, {params * 2 / 2**20:.0f} MiB per rank when sharded); "
        "rank 0 makes 8 new tokens per prompt, rank 1 many more"
    )
    print(
        f"{'regime':<16}{'weights held MiB':>17}{'RSS peak MiB r0':>16}{'RSS peak MiB r1':>16}{'wall s':>8}"
        f"{'tokens':>7}"
    )
    for regime, ranks in runs.items():
        peaks = [r["peak_bytes"] / 2**20 for r in ranks]
        held = max(r["peak_live_param_bytes"] for r in ranks) / 2**20
        print(
            f"{regime:<16}{held:>17.1f}{peaks[0]:>16.1f}{peaks[1]:>16.1f}"
            f"{max(r['seconds'] for r in ranks):>8.2f}{sum(r['new_tokens'] for r in ranks):>7}"
        )
    same = all(runs["gather"][r]["tokens"] == runs[k][r]["tokens"] for k in REGIMES for r in range(2))
    hf, gather, lock = (max(r["seconds"] for r in runs[k]) for k in ("hf_synced_gpus", "gather", "lockstep"))
    peak = {k: max(r["peak_bytes"] for r in runs[k]) for k in REGIMES}
    held = {k: max(r["peak_live_param_bytes"] for r in runs[k]) for k in REGIMES}
    print(f"weights held at once: gather-once / lockstep = {held['gather'] / max(held['lockstep'], 1):.2f}x")
    print(f"greedy tokens identical across the three: {same}")
    print(f"speed vs HF synced_gpus (its time / ours): gather-once {hf / gather:.2f}x, lockstep {hf / lock:.2f}x")
    print(
        f"peak memory: gather-once / lockstep = {peak['gather'] / max(peak['lockstep'], 1):.2f}x; "
        f"lockstep / HF synced_gpus = {peak['lockstep'] / max(peak['hf_synced_gpus'], 1):.2f}x"
    )
    print("(a shared 2-core machine: times are noisy; memory is the rank's RSS above its pre-rollout level)")


if __name__ == "__main__":
    main()
