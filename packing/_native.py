"""Loads nopad's compiled extensions (built from csrc/) when they are there, and tells whether an
optional kernel package (flash-attn, causal-conv1d, fla, mamba_ssm) is installed.

Without them nopad still works — the packer on the pure-Python reference in
``nopad.packing.bins.algorithms``, decode attention on PyTorch — only slower; we say so once per extension,
the first time it is needed, instead of failing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from types import ModuleType


def installed(package: str) -> bool:
    """Whether ``package`` is installed, found without importing it: a package that is there but
    fails to import deserves a warning, one that is absent does not."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def load_extension(name: str, what: str, fallback: str) -> ModuleType | None:
    """The compiled module ``name`` (the ``what``), or None with a one-time warning naming the
    ``fallback`` that runs instead."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        warnings.warn(
            f"nopad's compiled {what} is not available ({error}); using {fallback}. "
            "Rebuild with `pip install -e .` (needs a C++17 compiler).",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def native_packer() -> ModuleType | None:
    """The compiled packer, or None (the pure-Python reference is much slower on large datasets;
    ``benchmarks/bench_packing.py`` times the packers)."""
    return load_extension("nopad.packing._packer", "packer", "the pure-Python packer (much slower)")
