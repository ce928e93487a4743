"""One run at a time in an output directory.

An output directory can hold several runs (the README's SFT line and its ``accelerate launch`` line
both write ``runs/sft``). :func:`claim_run_dir` gives each run an id, a lock naming its process (two
runs at once used to delete each other's ``.step_N.incomplete``), and a ``metrics.jsonl`` of its
own.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from nopad.training.checkpoint import LOCK_FILE, METRICS_FILE, complete_checkpoints, lock_owner

logger = logging.getLogger(__name__)


def claim_run_dir(output_dir: str | Path, accelerator=None, *, resuming: bool = False) -> str:
    """Start a run in ``output_dir`` (main process only; returns the run id everywhere).

    Takes the directory's lock, or stops with the pid of the run that holds it. A fresh run (not a
    resume) moves an earlier run's ``metrics.jsonl`` aside to ``metrics.<its run id>.jsonl``, so the
    curves of one run never mix with another's; a resumed run continues the file. The lock is
    released when the process exits."""
    output_dir = Path(output_dir)
    run = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    if accelerator is not None and not accelerator.is_main_process:
        return run
    output_dir.mkdir(parents=True, exist_ok=True)
    previous = lock_owner(output_dir)
    if previous and previous.get("pid") != os.getpid() and _alive(previous):
        raise RuntimeError(
            f"{output_dir} is in use by another run (pid {previous.get('pid')} on {previous.get('host')}, "
            f"run {previous.get('run')}, since {previous.get('started')}); two runs writing one directory "
            "destroy each other's checkpoints: wait for it, stop it, or set another output directory. "
            f"If that run is gone, delete {output_dir / LOCK_FILE}"
        )
    if previous and previous.get("pid") != os.getpid():
        logger.warning(
            "%s: the run %s (pid %s) that locked it is gone; taking it over",
            output_dir,
            previous.get("run"),
            previous.get("pid"),
        )
    metrics = output_dir / METRICS_FILE
    if not resuming and metrics.is_file():
        old_run = previous.get("run") or time.strftime("%Y%m%d-%H%M%S", time.localtime(metrics.stat().st_mtime))
        aside = metrics.with_name(f"metrics.{old_run}.jsonl")
        metrics.rename(aside)
        logger.info("%s: an earlier run's metrics moved to %s; this run writes its own", output_dir, aside.name)
    if not resuming and complete_checkpoints(output_dir):
        logger.warning(
            "%s already holds checkpoints of an earlier run; this new run's checkpoints count as "
            "newer (model.path=%s and resume_from=latest take this run's newest). To continue the "
            "earlier run instead, set checkpoint.resume_from=latest",
            output_dir,
            output_dir,
        )
    owner = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "run": run,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (output_dir / LOCK_FILE).write_text(json.dumps(owner))
    atexit.register(release_run_dir, output_dir)
    return run


def release_run_dir(output_dir: str | Path) -> None:
    """Drop this process's lock on ``output_dir`` (another run's lock is left alone)."""
    lock = Path(output_dir) / LOCK_FILE
    if lock_owner(Path(output_dir)).get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


def _alive(owner: dict) -> bool:
    """Whether the process that wrote a lock still runs (one on another host counts as running)."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(owner.get("pid", 0)), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return int(owner.get("pid", 0)) > 0


# ----------------------------------------------------------------------------- the recipes' use
