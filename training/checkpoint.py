"""Checkpoints that are either complete or absent.

Why: a run killed while writing ``step_N`` used to leave a directory that looked like a checkpoint
(a truncated ``optimizer.bin``, no tokenizer) and that ``resume_from=latest`` then picked. Here a
checkpoint is written into ``.step_N.incomplete`` beside its target, marked complete, and renamed
into place in one step; ``latest`` is the newest complete one, and anything else found in the
output directory is skipped with a warning that names it.

Every rank calls :func:`save_checkpoint` with the same path (DeepSpeed and FSDP write per-rank
shards into it); the main process renames and prunes.

An output directory can hold several runs (:func:`nopad.training.run_dir.claim_run_dir` gives each its
id and lock); each checkpoint records its run and write time, and "latest" is the newest written, so the
newer run's ``step_3`` wins over an older run's ``step_5``.
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
LOCK_FILE = "nopad_run.lock"  # in the output directory while a run writes there: pid, host, run id (run_dir.py)
METRICS_FILE = "metrics.jsonl"
STATE_DIR = "training_state"  # inside step_N/: what resuming needs beyond the model directory


def step_of(path: Path) -> int | None:
    """N for a directory named ``step_N``, else None."""
    name = path.name
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def checkpoint_info(path: Path) -> dict:
    """What the completion marker of checkpoint ``path`` records (step, saved_at, run)."""
    try:
        return json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete ``step_N`` checkpoints of ``output_dir``, oldest written first (so the newest
    run's newest step is last, whatever the step numbers of older runs). Incomplete ones (a kill
    during the write, or a directory not written by nopad) are skipped with a warning."""
    output_dir = Path(output_dir)
    found = []
    for path in output_dir.glob("step_*") if output_dir.is_dir() else ():
        if step_of(path) is None or not path.is_dir():
            continue
        if is_complete(path):
            found.append(path)
        else:
            logger.warning(
                "skipping %s: it is not a complete checkpoint (no %s; the run that wrote it was "
                "probably stopped during the write)",
                path,
                COMPLETE_MARKER,
            )
    return sorted(found, key=lambda p: (checkpoint_info(p).get("saved_at", 0.0), step_of(p)))


def latest_checkpoint(output_dir: str | Path) -> Path:
    """The newest complete checkpoint in ``output_dir``; an error that says what was found if none."""
    found = complete_checkpoints(output_dir)
    if not found:
        incomplete = sorted(p.name for p in Path(output_dir).glob("*step_*"))
        raise FileNotFoundError(
            f"{output_dir} holds no complete step_N checkpoint"
            + (
                f" (only {', '.join(incomplete)}, written by a run that stopped before finishing them)"
                if incomplete
                else ""
            )
            + "; train first, or give the path of a complete checkpoint directory"
        )
    runs = {checkpoint_info(p).get("run") for p in found}
    if len(runs) > 1:
        logger.info(
            "%s holds checkpoints of %d runs; using the newest run's newest checkpoint, %s",
            output_dir,
            len(runs),
            found[-1].name,
        )
    return found[-1]


def dir_kind(path: str | Path) -> str | None:
    """What a directory holds, by the files nopad and its libraries write: ``"model"`` (an HF model
    directory, or a peft LoRA adapter's), ``"run"`` (a training run's output: ``step_N`` checkpoints, a
    lock or metrics), ``"training_state"`` (Accelerate's resume state inside a checkpoint), ``"dataset"`` (a
    ``save_to_disk`` directory, e.g. a packed dataset), ``"empty"``, or None (none of these)."""
    path = Path(path)
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    if not names:
        return "empty"
    if names & {"config.json", "adapter_config.json"}:
        return "model"
    if any(n.startswith(("step_", ".step_")) for n in names) or names & {LOCK_FILE, METRICS_FILE}:
        return "run"
    if names & {"dataset_info.json", "state.json", "dataset_dict.json"}:
        return "dataset"
    if path.name == "training_state" or any(n.startswith(("optimizer", "random_states", "scheduler")) for n in names):
        return "training_state"
    return None


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory, or the output directory of a training run (then its latest complete
    checkpoint), so ``model.path=runs/sft`` works after ``checkpoint.output_dir=runs/sft``. Any other
    directory is an error that says what it is and what to pass instead."""
    path = Path(path)
    kind = dir_kind(path)
    if kind == "model":
        return path
    if kind == "run":
        latest = latest_checkpoint(path)
        logger.info("model.path=%s is a training run's output: using its latest checkpoint %s", path, latest)
        return latest
    what = {
        "training_state": f"{path} is a checkpoint's training state (optimizer and RNG for resuming), not a "
        f"model: pass the checkpoint itself, model.path={path.parent}",
        "dataset": f"{path} is a saved dataset (e.g. nopad.recipes.preprocess's packed output), not a model: give "
        "it as the data (data.source= in SFT) and set model.path to a model",
        "empty": f"{path} is an empty directory, not a model",
    }.get(
        kind,
        f"{path} holds no config.json, so it is not a Hugging Face model directory (it holds "
        f"{', '.join(sorted(p.name for p in path.iterdir())[:8])})",
    )
    raise FileNotFoundError(
        f"model.path: {what}; give a Hugging Face model directory (with config.json), "
        "a training run's output directory, or model.path=smollm2"
    )


def save_checkpoint(
    path: str | Path,
    write: Callable[[Path], None],
    accelerator=None,
    *,
    keep_last: int | None = None,
    meta: dict | None = None,
) -> Path:
    """Write a checkpoint with ``write(tmp_dir)`` (called on every rank) and move it to ``path``
    when complete; then keep only the newest ``keep_last`` complete checkpoints beside it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{INCOMPLETE_SUFFIX}")
    main = accelerator is None or accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
        tmp.mkdir(parents=True)
    _barrier(accelerator)
    try:
        write(tmp)
    except (OSError, RuntimeError) as err:
        if not _is_write_failure(err):
            raise
        free = shutil.disk_usage(tmp.parent).free if tmp.parent.exists() else 0
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(
            f"could not write checkpoint {path} ({free / 2**20:.0f} MiB free on its disk; a full "
            f"disk is the usual cause): {err}. The partial copy was removed and the earlier "
            "checkpoints are intact; free space (or set checkpoint.keep_last) and resume with "
            "checkpoint.resume_from=latest"
        ) from err
    _barrier(accelerator)
    if main:
        info = {
            "step": step_of(path),
            "saved_at": time.time(),
            "run": lock_owner(path.parent).get("run"),
            **(meta or {}),
        }
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


def _is_write_failure(err: BaseException) -> bool:
    """An OSError (ENOSPC, EIO...) or torch's zip writer failing mid-file ("unexpected pos")."""
    text = str(err)
    return isinstance(err, OSError) or any(
        s in text for s in ("unexpected pos", "PytorchStreamWriter", "No space left")
    )


def _barrier(accelerator) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def resume_failure(checkpoint_dir: str | Path, err: BaseException) -> str:
    """Why loading ``checkpoint_dir``'s training state failed, in words: a model that differs from
    the checkpoint's (shapes or parameter names) is not cured by an earlier ``step_N``, and only a
    file reader's own words (a truncated zip or pickle) suggest a damaged file."""
    text = str(err)
    if any(s in text for s in ("size mismatch", "Missing key", "Unexpected key", "shape")):
        return (
            f"checkpoint {checkpoint_dir} was written for a different model than model.path "
            f"({text[:300]}); resume with the model.path of the run that wrote it, or start a fresh "
            "run in another checkpoint.output_dir"
        )
    if any(s in text for s in DAMAGE_SIGNS):
        return (
            f"could not load the training state of checkpoint {checkpoint_dir}: {text}; the file may be "
            "damaged: resume from an earlier step_N directory"
        )
    return (
        f"could not load the training state of checkpoint {checkpoint_dir}: {text[:300]}; resume with "
        "the recipe, model and settings of the run that wrote it, or start a new run in another output "
        "directory"
    )


# what a truncated or corrupt file makes torch, pickle or safetensors say
DAMAGE_SIGNS = (
    "PytorchStreamReader",
    "central directory",
    "unpickling",
    "truncated",
    "Ran out of input",
    "invalid load key",
    "EOF",
    "HeaderTooLarge",
    "InvalidHeader",
    "MetadataIncompleteBuffer",
    "corrupt",
)


def checkpoint_recipe(path: str | Path) -> str | None:
    """The recipe that wrote checkpoint ``path`` (``"sft"``, ``"grpo"``): recorded in its marker, or,
    for a checkpoint from before the marker held it, told by the progress state its recipe saves
    first (GRPO's has the prompt ``order``, SFT's not); None if neither says."""
    recorded = checkpoint_info(Path(path)).get("recipe")
    if recorded:
        return recorded
    import torch

    try:
        state = torch.load(Path(path) / STATE_DIR / "custom_checkpoint_0.pkl", weights_only=True)
    except Exception:  # no such file, or one this cannot read: the load itself will tell
        return None
    if isinstance(state, dict) and "order" in state:
        return "grpo"
    if isinstance(state, dict) and "step" in state:
        return "sft"
    return None


def lock_owner(output_dir: Path) -> dict:
    """What the lock of ``output_dir`` names (pid, host, run id; :mod:`nopad.training.run_dir`), or {}."""
    try:
        return json.loads((output_dir / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return {}


def save_training_checkpoint(
    accelerator,
    path: Path,
    save_model: Callable[[Path], None],
    keep_last: int | None = None,
    state_kwargs: dict | None = None,
    recipe: str | None = None,
) -> None:
    """``path`` becomes a model directory (``save_model(dir)`` writes it) holding, in
    ``training_state/``, everything registered with the Accelerator (optimizer, RNG, the recipe's
    progress) to resume from; written whole or not at all (:func:`save_checkpoint`). SFT and GRPO
    both checkpoint through here. ``state_kwargs`` go to ``save_state``; ``recipe`` (``"sft"``,
    ``"grpo"``) is recorded in the completion marker, so a resume by the other recipe is told apart."""

    def write(tmp: Path) -> None:
        accelerator.save_state(str(tmp / STATE_DIR), **(state_kwargs or {}))
        save_model(tmp)

    meta = {"recipe": recipe} if recipe else None
    save_checkpoint(path, write, accelerator, keep_last=keep_last, meta=meta)


def resume_path(resume_from: str, output_dir: Path) -> Path:
    """The checkpoint ``checkpoint.resume_from`` names: a step_N directory, or ``latest`` in
    ``output_dir`` (its newest complete one)."""
    return latest_checkpoint(output_dir) if resume_from == "latest" else Path(resume_from)


def resume_training(
    accelerator, resume_from: str, output_dir: Path, state_kwargs: dict | None = None, recipe: str | None = None
) -> Path:
    """Load ``resume_from`` (a step_N directory, or the ``latest`` complete one in ``output_dir``)
    into everything registered for checkpointing (``state_kwargs`` go to ``load_state``); returns
    the checkpoint's path. A checkpoint another ``recipe`` wrote is refused before loading."""
    path = resume_path(resume_from, output_dir)
    if not (path / STATE_DIR).is_dir():
        raise FileNotFoundError(
            f"checkpoint.resume_from={str(path)!r} holds no {STATE_DIR}/ "
            "written by this recipe; give a step_N directory of an earlier run"
        )
    written_by = checkpoint_recipe(path)
    if recipe and written_by and written_by != recipe:
        raise ValueError(
            f"checkpoint.resume_from={path} is a checkpoint of nopad.recipes.{written_by}, not of "
            f"nopad.recipes.{recipe}: a resume continues the run that wrote it. To start "
            f"nopad.recipes.{recipe} from that model, set model.path={path} and leave "
            "checkpoint.resume_from unset"
        )
    try:
        accelerator.load_state(str(path / STATE_DIR), **(state_kwargs or {}))
    except ValueError:  # our own: a resume under another plan, naming the setting
        raise
    except Exception as err:  # a damaged file: say which checkpoint, not only the zip reader's words
        raise RuntimeError(resume_failure(path, err)) from err
    return path


def append_metrics(output_dir: str | Path, record: dict) -> None:
    """One step's record appended to the run's ``metrics.jsonl`` (main process only): the run log
    of SFT and GRPO alike; a resumed run continues the file (:func:`trim_metrics`)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def trim_metrics(output_dir: str | Path, first_redone: int) -> None:
    """On resume: drop the records of steps ``>= first_redone``, which a run killed after its
    checkpoint had logged and the resumed run logs again, so each step appears once."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", -1) < first_redone]
    if len(kept) != len(lines):
        logger.info(
            "%s: dropping %d record(s) of steps >= %d, logged after the checkpoint resumed from",
            path,
            len(lines) - len(kept),
            first_redone,
        )
        path.write_text("".join(line + "\n" for line in kept))
