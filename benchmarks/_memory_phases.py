"""``python -m nopad.recipes.sft`` with the RSS of each phase logged: ``bench_memory.py --phases`` launches
this in its place. Imports, the model load, ``accelerator.prepare``, each micro-batch's forward and
backward, DeepSpeed's optimizer step and the checkpoint save each end with one JSON line in
``$MEMORY_PHASES_DIR/rank<R>.jsonl``: RSS at the phase's end, the highest RSS sampled (every 10 ms)
during it, and glibc's main-arena heap in use and freed-but-kept, and its mmapped blocks (mallinfo2).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) * 1024


class PhaseLog:
    """The current phase's name and highest RSS (a sampling thread), one line per ended phase."""

    def __init__(self, path: str):
        self.out = open(path, "w")
        self.libc = ctypes.CDLL(None)
        self.libc.mallinfo2.restype = _MallInfo2
        self.phase, self.peak, self.t0 = "start", 0, time.time()
        self.lock = threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            rss = _rss()
            with self.lock:
                self.peak = max(self.peak, rss)
            time.sleep(0.01)

    def mark(self, name: str) -> None:
        """End the current phase (one line), start ``name``."""
        rss, heap = _rss(), self.libc.mallinfo2()
        with self.lock:
            line = {
                "phase": self.phase,
                "t": round(time.time() - self.t0, 1),
                "rss": rss,
                "peak": max(self.peak, rss),
                "heap_used": heap.uordblks,
                "heap_free": heap.fordblks,
                "mmapped": heap.hblkhd,
            }
            self.phase, self.peak = name, rss
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


def _wrap(owner, name: str, log: PhaseLog, label, after: str | None = None) -> None:
    """Mark ``label`` (a string, or a function of the call count) before ``owner.name`` runs."""
    fn, calls = getattr(owner, name), [0]

    def marked(*args, **kwargs):
        calls[0] += 1
        log.mark(label if isinstance(label, str) else label(calls[0]))
        result = fn(*args, **kwargs)
        if after:
            log.mark(after)
        return result

    setattr(owner, name, marked)


def main() -> None:
    log = PhaseLog(os.path.join(os.environ["MEMORY_PHASES_DIR"], f"rank{os.environ.get('RANK', '0')}.jsonl"))
    log.mark("import torch, transformers, deepspeed, accelerate")
    import accelerate  # noqa: F401
    import deepspeed
    import torch  # noqa: F401
    import transformers  # noqa: F401

    log.mark("import nopad; make the accelerator")
    import nopad.recipes.sft as recipe
    import nopad.training.checkpoint as checkpoint
    import nopad.training.sft as sft_loop

    micro_batch = [0]
    engine = deepspeed.runtime.engine.DeepSpeedEngine
    _wrap(recipe, "load_model", log, "load the model", after="rows, loader, optimizer")
    _wrap(recipe, "prepare", log, "accelerator.prepare", after="after prepare")
    _wrap(sft_loop, "row_nll_sum", log, lambda n: micro_batch.__setitem__(0, n) or f"forward {n}")
    _wrap(engine, "backward", log, lambda _: f"backward {micro_batch[0]}")
    _wrap(engine, "step", log, lambda _: f"engine.step {micro_batch[0]}", after="after engine.step")
    _wrap(checkpoint, "save_training_checkpoint", log, "save: training state", after="after save")
    _wrap(recipe, "save_model_dir", log, "save: model directory")
    recipe.main()
    log.mark("end")


if __name__ == "__main__":
    main()
