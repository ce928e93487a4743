"""The recipes' console logging (:func:`setup_logging`): nopad at INFO, the libraries underneath
quiet unless they warn."""

from __future__ import annotations

import os

NOISY_LOGGERS = (
    "accelerate.checkpointing",  # 8 "saved ... to ..." lines per checkpoint
    "accelerate.accelerator",  # "loading states from ..." per resume
    "DeepSpeed",
    "deepspeed",
)  # its CPU-accelerator notice in every run, its config dumps
# where a deprecation FutureWarning is for nopad's developers, not for the user of a recipe: raised in
# the libraries underneath, or attributed to nopad's own call of them
QUIET_FUTURE_WARNINGS = (
    r"(torch|transformers|accelerate|deepspeed|trl|peft|datasets|huggingface_hub|"
    r"safetensors|nopad)(\..*)?$"
)


def setup_logging(fmt: str = "%(asctime)s %(name)s: %(message)s") -> None:
    """The recipes' console logging: INFO for nopad, warnings only from the libraries whose INFO is
    noise to a user, and no deprecation FutureWarnings from the libraries underneath or nopad's calls
    of them (the recipes call them as documented). Every other warning still shows, a FutureWarning
    from the user's own code (a reward module) included."""
    import logging
    import warnings

    logging.basicConfig(level=logging.INFO, format=fmt)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=QUIET_FUTURE_WARNINGS)
    import torch

    if not torch.cuda.is_available():  # what DeepSpeed picks anyway, without its warning every run
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
