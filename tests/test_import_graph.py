"""The packages' import graph: packing is the core; dataloaders and inference stand side by side
on it; training sits on both; recipes (scripts) sit on top and nothing imports them. Imports
inside functions count too: a lazy import is still a dependency."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("packing", "dataloaders", "inference", "training", "assets", "recipes")
# what each package may import, besides itself
ALLOWED = {
    "packing": set(),
    "assets": set(),
    "dataloaders": {"packing"},
    "inference": {"packing"},
    "training": {"packing", "dataloaders", "inference"},
    "recipes": {"packing", "dataloaders", "inference", "training", "assets"},
}


def imports_of(package: str) -> dict[str, set[str]]:
    """Project packages imported by each module of ``package``."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names & set(PACKAGES)
    return found


def test_each_package_imports_only_the_layers_below_it():
    wrong = []
    for package in PACKAGES:
        for module, names in imports_of(package).items():
            for name in names - {package} - ALLOWED[package]:
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


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
