"""Host memory of the README's two-process DeepSpeed ZeRO-3 SFT of SmolLM2-135M.

Runs the README's commands on 2048-token rows (preprocess the sample chats at capacity 2048, where
the README's quick run packs 512, then
``accelerate launch --config_file recipes/configs/accelerate_zero3.yaml -m nopad.recipes.sft``) with fewer
optimizer steps, samples every process of the launch through /proc while it runs, and prints each
rank's peak RSS (the kernel's own high-water mark, VmHWM), the peak of the whole tree's summed RSS,
and their ratio to the model-state floor: fp32 parameters + gradients + Adam's two moments for the
model, split over the ranks (16 bytes per parameter / world size), the least ZeRO-3 can hold.

    python benchmarks/bench_memory.py                  # 1 optimizer step (2 micro-batches per rank)
    python benchmarks/bench_memory.py --steps 2 --timeout 1800
    python benchmarks/bench_memory.py train.gradient_checkpointing=false   # extra recipe overrides
    python benchmarks/bench_memory.py --quick          # smoke run: the same launch on a tiny random Llama
    python benchmarks/bench_memory.py --phases train.gradient_checkpointing=true   # + RSS per phase

``--phases`` launches the recipe through ``benchmarks/_memory_phases.py``, which logs each rank's
RSS at the end of every phase (imports, model load, ``accelerator.prepare``, each forward and
backward, DeepSpeed's step, the save), the highest RSS during it, and how much of the process's
heap glibc holds freed but keeps (mallinfo2: main arena), and prints them per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere
STATE_BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weight, gradient, Adam exp_avg + exp_avg_sq
WORLD = 2


def smollm2_params() -> int:
    """SmolLM2-135M's parameter count (tied embeddings counted once), from its config on ``meta``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nopad.assets.smollm2 import _cache_dir, load_smollm2_tokenizer

    load_smollm2_tokenizer()
    if not (_cache_dir() / "config.json").is_file():
        from nopad.assets.smollm2 import load_smollm2

        load_smollm2()  # writes the cache once
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(_cache_dir()))
    return sum(p.numel() for p in model.parameters())


def tiny_params() -> int:
    """The parameter count of the recipes' ``tiny:llama`` (``--quick``)."""
    from nopad.recipes.tiny_model import tiny_causal_lm

    model, _ = tiny_causal_lm("llama")
    return sum(p.numel() for p in model.parameters())


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/*/stat parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of ``pid`` in bytes (empty once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in lines) if k in ("VmRSS", "VmHWM")}


def _rank(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        return None
    rank = env.get(b"RANK")
    return None if rank is None else rank.decode()


class TreeSampler(threading.Thread):
    """Samples the RSS of a process tree every ``interval`` s: the peak summed RSS, and each
    rank's high-water mark (VmHWM, exact even between samples)."""

    def __init__(self, root: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_total = 0
        self.rank_hwm: dict[str, int] = {}
        self.launcher_hwm = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            total = 0
            for pid in [self.root, *_children(self.root)]:
                s = _status(pid)
                if not s:
                    continue
                total += s["VmRSS"]
                if pid == self.root:
                    self.launcher_hwm = max(self.launcher_hwm, s["VmHWM"])
                elif (rank := _rank(pid)) is not None:
                    self.rank_hwm[rank] = max(self.rank_hwm.get(rank, 0), s["VmHWM"])
            self.peak_total = max(self.peak_total, total)
            time.sleep(self.interval)


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, TreeSampler]:
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc = proc.wait()
        print(f"timed out after {timeout:.0f} s; killed", flush=True)
    sampler.done.set()
    sampler.join()
    log.seek(0)
    return rc, log.read(), sampler


def print_phases(work: Path) -> None:
    """Each rank's phases from ``_memory_phases.py``: GB at the end, highest during, glibc's heap."""
    import json

    for path in sorted(work.glob("rank*.jsonl")):
        print(
            f"{path.stem}: phase (GB)                                end  highest  heap used  heap freed-kept  mmapped"
        )
        for line in path.read_text().splitlines():
            r = {k: v / 1e9 if isinstance(v, int) else v for k, v in json.loads(line).items()}
            print(
                f"  {r['phase'][:50]:50s} {r['rss']:5.2f}  {r['peak']:7.2f}  {r['heap_used']:9.2f}  "
                f"{r['heap_free']:16.2f}  {r['mmapped']:7.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps (README: the whole epoch)")
    parser.add_argument("--timeout", type=float, default=1500.0)
    parser.add_argument("--workdir", default=None, help="keep the packed data and run here")
    parser.add_argument("--quick", action="store_true", help="the same ZeRO-3 launch and report on a tiny random Llama")
    parser.add_argument("--phases", action="store_true", help="log and print each rank's RSS per phase")
    parser.add_argument("overrides", nargs="*", help="nopad.recipes.sft overrides added to the README's line")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_memory_"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    packed = work / "packed_chat"
    if args.quick:  # the harness end to end in seconds: no SmolLM2, no preprocess
        args.overrides = ["model.path=tiny:llama", "data.tokens_per_batch=256", *args.overrides]
    if not args.quick and not packed.is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "nopad.recipes.preprocess",
                "input=recipes/data/chat_sample.jsonl",
                f"output={packed}",
                "capacity=2048",
            ],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    if args.phases:
        env["MEMORY_PHASES_DIR"] = str(work)
    recipe = ["benchmarks/_memory_phases.py"] if args.phases else ["-m", "nopad.recipes.sft"]
    with socket.socket() as sock:  # a free rendezvous port: on 29500, another launch held us for minutes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--main_process_port",
        str(port),
        "--config_file",
        "recipes/configs/accelerate_zero3.yaml",
        *recipe,
        "data.source=synthetic" if args.quick else f"data.source={packed}",
        f"checkpoint.output_dir={work / 'sft'}",
        f"train.max_steps={args.steps}",
        "train.progress=false",
        *args.overrides,
    ]
    print("$ " + " ".join(cmd[2:]), flush=True)
    start = time.perf_counter()
    rc, out, s = _run(cmd, env, args.timeout)
    took = time.perf_counter() - start
    if rc != 0:
        print(out[-3000:])
        print(f"the ZeRO-3 run FAILED (exit {rc}); the peaks below are up to the failure")
    name, params = ("tiny:llama", tiny_params()) if args.quick else ("SmolLM2-135M", smollm2_params())
    floor = params * STATE_BYTES_PER_PARAM / WORLD
    gb = 1e9
    print(
        f"{name} ({params:,} parameters), ZeRO-3 on {WORLD} CPU processes, {args.steps} optimizer step(s), {took:.0f} s"
    )
    print(f"model-state floor per rank (fp32 params + grads + Adam, / {WORLD}): {floor / gb:.2f} GB")
    for rank in sorted(s.rank_hwm):
        hwm = s.rank_hwm[rank]
        print(f"rank {rank}: peak RSS {hwm / gb:.2f} GB = {hwm / floor:.2f}x the floor")
    print(f"launcher: peak RSS {s.launcher_hwm / gb:.2f} GB")
    print(
        f"whole launch: peak summed RSS {s.peak_total / gb:.2f} GB = {s.peak_total / (floor * WORLD):.2f}x "
        f"the floor of both ranks"
    )
    if args.phases:
        print_phases(work)
    if args.workdir is None:  # the packed data and the checkpoint were only the run's
        shutil.rmtree(work, ignore_errors=True)
    if rc != 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
