"""Which installed CUDA kernel package a hybrid layer calls: the one lookup that the causal conv
(causal-conv1d), the delta rules (fla) and the Mamba2 scans (mamba_ssm) share, so that one
environment variable, ``NOPAD_MIXER_KERNELS``, picks for all of them: ``auto`` (default: the
package on CUDA tensors when installed), ``package`` (the package whenever installed, whatever
the device: the tests' CPU stand-ins) or ``reference`` (nopad's PyTorch code everywhere).

A package that is installed but fails to import (a build for another torch or CUDA), or that a
caller finds cannot run here (:func:`disable`: fla's backward on some GPU / Triton pairs), is
reported once and then treated as absent, so the layer still runs, on the reference."""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable

import torch

from nopad.packing._native import installed

KERNELS_ENV = "NOPAD_MIXER_KERNELS"
_BROKEN: set[str] = set()  # "module.name" of installed packages that failed to import (reported once)


def kernel_choice() -> str:
    """``NOPAD_MIXER_KERNELS``: ``auto``, ``package`` or ``reference`` (see the module docstring)."""
    choice = os.environ.get(KERNELS_ENV, "auto").lower()
    if choice not in ("auto", "package", "reference"):
        raise ValueError(f"{KERNELS_ENV}={choice!r}; use auto, package or reference")
    return choice


def package_function(module: str, name: str, tensor: torch.Tensor) -> Callable | None:
    """``module.name`` when its package is installed and chosen for ``tensor`` (see
    :func:`kernel_choice`), else None: the reference runs. Not cached (a module already imported
    is a dictionary look-up), so a package put on ``sys.modules`` later is seen."""
    choice = kernel_choice()
    if choice == "reference" or (choice == "auto" and not tensor.is_cuda):
        return None
    if f"{module}.{name}" in _BROKEN or not installed(module.split(".")[0]):
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, OSError, AttributeError) as error:
        disable(module, name, f"does not import ({error})")
        return None


def disable(module: str, name: str, why: str) -> None:
    """Report once that ``module.name`` is installed but ``why`` (it cannot run here); from then
    on :func:`package_function` returns None for it, so the reference runs."""
    if f"{module}.{name}" in _BROKEN:
        return
    _BROKEN.add(f"{module}.{name}")
    warnings.warn(
        f"{module}.{name} is installed but {why}; nopad's hybrid layers use their PyTorch reference instead",
        RuntimeWarning,
        stacklevel=3,
    )
