"""The boundary between a recipe and its user's shell: an error nopad raises on purpose (a NaN
reward, a run directory in use, a damaged checkpoint, a missing optional dependency) is one line on
stderr, ``nopad.recipes.sft: error: ...``, as a config error already is; ``NOPAD_DEBUG=1`` shows the
traceback behind it.

"On purpose" means the exception was raised by a ``raise`` statement in nopad's own source. Those
messages are written for the user and already say what to do; a traceback in front of them only
hides the last line. Anything else (a bug in nopad, in a library underneath, in the user's reward
function) keeps its traceback, which is what its reader needs.

Why not one exception family (``class NopadError``)? The errors are ValueError, RuntimeError,
OSError and ImportError by Python's convention, callers and tests catch them as such, and a family
would touch every ``raise`` in the project; the raise site already tells which ones are nopad's.
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
DEBUG_ENV = "NOPAD_DEBUG"  # NOPAD_DEBUG=1: an error keeps its full traceback
NOPAD_PACKAGES = ("packing", "dataloaders", "inference", "training", "recipes", "assets")
_ROOT = Path(__file__).resolve().parents[1]


def raised_on_purpose(err: BaseException) -> bool:
    """Whether ``err`` comes from a ``raise`` statement in nopad's source (not from a library
    underneath, nor from a nopad line that failed by accident, like ``int("x")``)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    if not path.is_relative_to(_ROOT) or path.relative_to(_ROOT).parts[0] not in NOPAD_PACKAGES:
        return False
    return linecache.getline(str(path), tb.tb_lineno).lstrip().startswith("raise")


def run_recipe(main: Callable[[], T], prog: str) -> T:
    """``main()``, with an error nopad raised on purpose printed as one line (exit code 1)."""
    try:
        return main()
    except Exception as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0") or not raised_on_purpose(err):
            raise
        print(f"{prog}: error: {err} ({DEBUG_ENV}=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
