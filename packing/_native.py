"""Loads the compiled packer (``packing._packer``, built from csrc/packer.cpp) if it is there.

Without it nopad still works on the pure-Python reference in ``packing.algorithms``, only slower;
we say so once, the first time a packer is needed, instead of failing.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

_module: ModuleType | None = None
_checked = False


def native_packer() -> ModuleType | None:
    """The compiled module, or None (with a one-time warning) when it is not built."""
    global _module, _checked
    if not _checked:
        _checked = True
        try:
            _module = importlib.import_module("packing._packer")
        except ImportError as error:
            message = (
                f"nopad's compiled packer is not available ({error}); using the pure-Python packer, "
                "which is ~50x slower. Rebuild with `pip install -e .` (needs a C++17 compiler)."
            )
            warnings.warn(message, RuntimeWarning, stacklevel=3)
    return _module
