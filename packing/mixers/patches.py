"""nopad's changes to transformers, made on first use and undone on request.

nopad rebinds three things inside transformers: its kernel hook and the kernel functions of the
hybrid model modules (:mod:`nopad.packing.mixers.hf_kernels`), the Mamba2 families' kernel globals
(:mod:`nopad.packing.mixers.mamba2`, whose install also checks the scan by running it), and the mask
builder's argument step (:mod:`nopad.packing.hf.mask_args`: no host sync under nopad). Importing nopad
does none of them: an import that computes starts OpenMP's threads, and a process forked after it
(``multiprocessing``'s fork start method, ``datasets.map(num_proc=)``, a forkserver preloading
nopad) can hang in its first multi-threaded GEMM. So the patches go in when nopad is first used
on a model: registering the ``"nopad"`` attention, checking a model (every packed or tree forward,
``verify`` and ``Generator`` check it first).
"""

from __future__ import annotations

_installed = False


def install() -> None:
    """Patch transformers for nopad (idempotent; a flag check after the first call)."""
    global _installed
    if _installed:
        return
    from nopad.packing.hf import compat, mask_args
    from nopad.packing.mixers import hf_kernels, mamba2

    compat.check()  # before the first change: an untested transformers is refused, not patched
    hf_kernels.install()
    mamba2.mixers()
    mask_args.install()
    _installed = True


def uninstall() -> None:
    """Give transformers back what nopad rebound (tests); the next use installs again."""
    global _installed
    from nopad.packing.hf import mask_args
    from nopad.packing.mixers import hf_kernels, mamba2

    hf_kernels.uninstall()
    mamba2.uninstall()
    mask_args.uninstall()
    _installed = False


def installed() -> bool:
    return _installed
