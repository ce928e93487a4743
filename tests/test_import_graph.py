"""The packages' import graph: packing is the core; dataloaders and inference stand side by side
on it; training sits on both; recipes (scripts) sit on top and nothing imports them; benchmarks
may import everything and only tests import them. Imports inside functions count too: a lazy
import is still a dependency. No cycle either between packages or between modules. Of the
library, only ``training/trl/`` imports TRL: its private names change between releases, so one
package holds every use of them.

One import name: the folders install as ``nopad.<folder>``, so every import says ``nopad.``, and
nothing else is installed (``inference``, ``recipes`` and ``dataloaders`` are other distributions'
names on the package index, and one installed beside nopad would shadow ours or be shadowed)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("packing", "dataloaders", "inference", "training", "assets", "recipes", "benchmarks")
# what each package may import, besides itself (tests/ are not scanned: they may import anything)
ALLOWED = {
    "packing": set(),
    "assets": set(),
    "dataloaders": {"packing"},
    "inference": {"packing"},
    "training": {"packing", "dataloaders", "inference"},
    "recipes": {"packing", "dataloaders", "inference", "training", "assets"},
    "benchmarks": {"packing", "dataloaders", "inference", "training", "assets", "recipes"},
}


FOLDERS = PACKAGES[:-1]  # what installs, each as nopad.<folder>


def imported_names(path: Path) -> list[str]:
    """The absolute module names one module imports, lazy ones included (``from nopad import x``
    is ``nopad.x``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"nopad.{a.name}" for a in node.names] if node.module == "nopad" else [node.module]
    return names


def top_level_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports of one module (``nopad.packing...``: ``packing``)."""
    parts = [name.split(".") for name in imported_names(path)]
    return {p[1] if p[0] == "nopad" and len(p) > 1 else p[0] for p in parts}


def imports_of(package: str) -> dict[str, set[str]]:
    """Project packages imported by each module of ``package``."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        found[str(path.relative_to(ROOT))] = top_level_imports(path) & set(PACKAGES)
    return found


def test_each_package_imports_only_the_layers_below_it():
    wrong = []
    for package in PACKAGES:
        for module, names in imports_of(package).items():
            for name in names - {package} - ALLOWED[package]:
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_only_training_trl_imports_trl():
    """benchmarks/ import TRL too: it is the peer they measure against."""
    fence = ROOT / "training" / "trl"
    wrong = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        if package != "benchmarks"
        for path in sorted((ROOT / package).rglob("*.py"))
        if fence not in path.parents and "trl" in top_level_imports(path)
    ]
    assert not wrong, f"these modules import trl outside training/trl/ (move that code there): {wrong}"
    assert "trl" in top_level_imports(fence / "grpo_trainer.py")  # the scan sees lazy imports


def test_the_package_graph_has_no_cycles():
    graph = {p: set().union(*imports_of(p).values()) - {p} for p in PACKAGES}
    visiting, done = set(), set()

    def visit(node, path):
        assert node not in visiting, f"import cycle: {' -> '.join(path + [node])}"
        if node in done:
            return
        visiting.add(node)
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        visiting.discard(node)
        done.add(node)

    for package in PACKAGES:
        visit(package, [])


def module_name(path: Path) -> str:
    """The name a module is imported by: ``nopad.<folder>...`` for what installs."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("nopad", *parts) if parts[0] in FOLDERS else parts)


def module_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (``from a.b import c`` is ``a.b.c`` when c
    is a module, else ``a.b``; relative imports resolved)."""
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = ".".join(p for p in (package, base) if p)
                found |= {resolve(f"{base}.{a.name}") for a in node.names}
        graph[module] = found - {None, module}
    return graph


def test_the_batch_invariant_mode_sits_below_the_attention_that_reads_it():
    """``packing/invariance.py`` (the mode's state and GEMM tiles) is read by the attention backends;
    what needs both (whether the mode is supported) is ``packing/invariance_support.py``."""
    mode = imported_names(ROOT / "packing" / "invariance.py")
    assert not [name for name in mode if name.startswith("nopad.packing.attention")]
    assert "from nopad.packing import invariance" in (ROOT / "packing" / "attention" / "plan.py").read_text()


def test_the_module_graph_has_no_cycles():
    graph = module_graph()
    assert "nopad.packing.attention.registry" in graph and "benchmarks.bench_generate" in graph
    state = {}  # module -> "visiting" | "done"

    def visit(node, path):
        assert state.get(node) != "visiting", f"import cycle: {' -> '.join(path + [node])}"
        if state.get(node) == "done":
            return
        state[node] = "visiting"
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        state[node] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_tests_mirror_the_packages():
    """A test of ``<package>/`` lives in ``tests/<package>/`` and is named ``test_<package>_*``;
    shared helpers live in ``tests/support/``. Only the whole-project checks sit at ``tests/``."""
    tests = ROOT / "tests"
    folders = {"packing", "dataloaders", "inference", "training", "recipes", "benchmarks", "gpu", "support"}
    whole_project = {
        "conftest.py",
        "test_code_size.py",
        "test_import_graph.py",
        "test_nonfinite.py",
        "test_readme.py",
        "test_readme_launch.py",
    }
    misplaced = [p.name for p in tests.glob("*.py") if p.name not in whole_project]
    for path in tests.glob("*/*.py"):
        folder = path.parent.name
        if folder not in folders:
            misplaced.append(str(path.relative_to(tests)))
        elif folder in {"packing", "dataloaders", "inference", "training", "recipes"}:
            if not path.name.startswith(f"test_{folder}_"):
                misplaced.append(str(path.relative_to(tests)))
    assert not misplaced, f"move these into tests/<package>/ (helpers into tests/support/): {misplaced}"


def test_every_import_of_nopad_says_nopad():
    """A bare ``from nopad import packing`` would load a second copy of a module (its registries split in two)
    from the repository root, and nothing at all once installed."""
    scanned = [p for folder in (*PACKAGES, "tests") for p in sorted((ROOT / folder).rglob("*.py"))]
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in scanned
        for name in imported_names(path)
        if name.split(".")[0] in FOLDERS
    ]
    assert not wrong, "import these as nopad.<name>:\n" + "\n".join(wrong)


def test_only_nopad_is_installed():
    """pyproject's packages are every package folder, each under nopad; the compiled extensions
    and the console scripts are nopad's too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    folders = sorted(
        "nopad." + ".".join(p.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("__init__.py")
    )
    assert sorted(setuptools["packages"]) == sorted(["nopad", *folders])
    assert setuptools["package-dir"] == {"nopad": "nopad", **{f"nopad.{f}": f for f in FOLDERS}}
    assert all(target.startswith("nopad.") for target in project["project"]["scripts"].values())
    extensions = [
        line.split('"')[1]
        for line in (ROOT / "setup.py").read_text().splitlines()
        if line.strip().startswith('"') and line.strip().endswith('",') and "._" in line
    ]
    assert extensions and all(name.startswith("nopad.packing._") for name in extensions)


def test_the_install_answers_to_nopad_alone(tmp_path):
    """Outside the repository, as a user's script sees the install: ``nopad.*`` imports, and none
    of the folder names does (they would shadow, or be shadowed by, other distributions)."""
    script = (
        "import importlib.util, nopad.packing, nopad.inference, nopad.recipes; "
        f"print([n for n in {FOLDERS!r} if importlib.util.find_spec(n) is not None])"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"installed outside nopad: {out.stdout}"
