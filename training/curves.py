"""Training curves to look at: a PNG next to the run's ``metrics.jsonl``.

Why: a run that logs only numbers is read line by line; a plot of loss, reward and the rollout /
trainer log-prob gap shows at a glance whether it learns. matplotlib is optional (the ``test`` and
``bench`` extras have it); without it the PNG is skipped with one log line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def tracker_config(cfg: dict, prefix: str = "") -> dict:
    """A recipe config flattened to ``{"train.lr": 1e-5, ...}`` with scalar values, the shape
    every Accelerate tracker accepts as hyper-parameters."""
    flat = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(tracker_config(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (one JSON object per optimizer step)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_curves(metrics_path: str | Path, keys: Sequence[str], title: str) -> Path | None:
    """Plot ``keys`` of the records in ``metrics_path`` against their ``step`` into
    ``curves.png`` beside it; returns the PNG's path, or None when there is nothing to plot."""
    records = read_metrics(metrics_path)
    keys = [k for k in keys if any(k in r for r in records)]
    if not records or not keys:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no curves.png (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = [(r.get("step", i), r[key]) for i, r in enumerate(records) if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(metrics_path).with_name("curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def finish_trackers(accelerator) -> None:
    """Flush and close the run's trackers. (Not ``accelerator.end_training()``, which also tears
    down the process group a caller may still use.)"""
    for tracker in accelerator.trackers:
        tracker.finish()
