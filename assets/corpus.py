"""An embedded default corpus, built offline from the docstrings of Python's own standard library.

The demo and tests need real text of varied length without downloads: every Python install ships
thousands of module, class and function docstrings, from one-liners to multi-page module guides.
Files are parsed with ``ast`` (nothing is imported) in sorted order, so a given Python version
always yields the same documents. Parsing takes several seconds, so the documents are cached as
JSON next to the model cache (``~/.cache/nopad``, or ``$NOPAD_CACHE``).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

# Tests, vendored and generated code, and packages that are mostly tables rather than prose.
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "encodings",
    "lib2to3",
    "idlelib",
    "turtledemo",
    "ensurepip",
    "pydoc_data",
    "distutils",
}
_CACHE_VERSION = 1


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _docstrings(path: Path, module: str) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs = []
    stack: list[tuple[ast.AST, str]] = [(tree, module)]
    while stack:
        node, name = stack.pop(0)
        doc = ast.get_docstring(node, clean=True) if isinstance(node, _HAS_DOC) else None
        if doc:
            docs.append(f"{name}\n\n{doc}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((child, f"{name}.{child.name}"))
    return docs


_HAS_DOC = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_docstrings() -> list[str]:
    """Every docstring of the standard library as ``"qualified.name\n\ndocstring"`` (cached)."""
    version = ".".join(map(str, sys.version_info[:3]))
    root = Path(os.environ.get("NOPAD_CACHE") or Path.home() / ".cache" / "nopad")
    cache = root / f"corpus-stdlib-docstrings-py{version}-v{_CACHE_VERSION}.json"
    if cache.is_file():
        return json.loads(cache.read_text(encoding="utf-8"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    logger.info("building the embedded corpus from the docstrings under %s (once)", stdlib)
    docs: list[str] = []
    for path in _stdlib_files():
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        docs.extend(_docstrings(path, module))
    if not docs:
        raise RuntimeError(f"no docstrings found under {stdlib}; is the Python standard library installed?")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(docs), encoding="utf-8")
        tmp.replace(cache)
    except OSError as error:  # a read-only home is fine, we just parse again next time
        logger.warning("could not cache the corpus at %s: %s", cache, error)
    return docs


def load_corpus(max_documents: int | None = 4000, min_chars: int = 80) -> list[str]:
    """Standard-library docstrings at least ``min_chars`` long, evenly thinned to
    ``max_documents`` so every part of the library stays represented."""
    docs = [d for d in stdlib_docstrings() if len(d) >= min_chars]
    if max_documents is not None and len(docs) > max_documents:
        step = len(docs) / max_documents
        docs = [docs[int(i * step)] for i in range(max_documents)]
    return docs
