"""Checkpoints that are either complete or absent.

Why: a run killed while writing ``step_N`` used to leave a directory that looked like a checkpoint
(a truncated ``optimizer.bin``, no tokenizer) and that ``resume_from=latest`` then picked. Here a
checkpoint is written into ``.step_N.incomplete`` beside its target, marked complete, and renamed
into place in one step; ``latest`` is the newest complete one, and anything else found in the
output directory is skipped with a warning that names it.

Every rank calls :func:`save_checkpoint` with the same path (DeepSpeed and FSDP write per-rank
shards into it); the main process renames and prunes.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "nopad_checkpoint.json"  # written last, inside the temporary directory
INCOMPLETE_SUFFIX = ".incomplete"


def step_of(path: Path) -> int | None:
    """N for a directory named ``step_N``, else None."""
    name = path.name
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete ``step_N`` checkpoints of ``output_dir``, oldest first. Incomplete ones (a
    kill during the write, or a directory not written by nopad) are skipped with a warning."""
    output_dir = Path(output_dir)
    found = []
    for path in output_dir.glob("step_*") if output_dir.is_dir() else ():
        if step_of(path) is None or not path.is_dir():
            continue
        if is_complete(path):
            found.append(path)
        else:
            logger.warning("skipping %s: it is not a complete checkpoint (no %s; the run that wrote it was "
                           "probably stopped during the write)", path, COMPLETE_MARKER)
    return sorted(found, key=step_of)


def latest_checkpoint(output_dir: str | Path) -> Path:
    """The newest complete checkpoint in ``output_dir``; an error that says what was found if none."""
    found = complete_checkpoints(output_dir)
    if not found:
        raise FileNotFoundError(f"{output_dir} holds no complete step_N checkpoint; train first, or give "
                                "the path of a checkpoint directory")
    return found[-1]


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory, or the output directory of a training run (then its latest complete
    checkpoint), so ``model.path=runs/sft`` works after ``checkpoint.output_dir=runs/sft``."""
    path = Path(path)
    if (path / "config.json").is_file() or not any(path.glob("step_*")):
        return path
    latest = latest_checkpoint(path)
    logger.info("model.path=%s is a training run's output: using its latest checkpoint %s", path, latest)
    return latest


def save_checkpoint(path: str | Path, write: Callable[[Path], None], accelerator=None, *,
                    keep_last: int | None = None, meta: dict | None = None) -> Path:
    """Write a checkpoint with ``write(tmp_dir)`` (called on every rank) and move it to ``path``
    when complete; then keep only the newest ``keep_last`` complete checkpoints beside it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{INCOMPLETE_SUFFIX}")
    main = accelerator is None or accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
        tmp.mkdir(parents=True)
    _barrier(accelerator)
    write(tmp)
    _barrier(accelerator)
    if main:
        info = {"step": step_of(path), "saved_at": time.time(), **(meta or {})}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(info))
        if path.exists():  # the same step written again (e.g. a rerun): replace it whole
            shutil.rmtree(path)
        tmp.rename(path)
        if keep_last:
            for old in complete_checkpoints(path.parent)[:-keep_last]:
                logger.info("removing old checkpoint %s (checkpoint.keep_last=%d)", old, keep_last)
                shutil.rmtree(old, ignore_errors=True)
    _barrier(accelerator)
    return path


def _barrier(accelerator) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()
