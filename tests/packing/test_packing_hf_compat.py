"""The transformers fence (nopad.packing.hf.compat): every transformers name nopad's code reaches into is
listed there, the installed transformers passes, and an untested or differing one is refused in one
line, once per process, before nopad rebinds anything.

What counts as reaching into transformers (the scan, over every module of the library packages but
``training/trl``, which is TRL's fence): read from the source with ``ast``, never by running it.

- ``from transformers... import _x``: a private name imported;
- ``X._x`` (read or written) and ``getattr/hasattr/setattr/delattr(X, "_x")``, a private
  (underscore, not dunder) name, where ``X`` holds a transformers object: a name this module
  imported from transformers (``transformers``, ``hub_kernels``, ``Trainer``...) or an attribute
  chain rooted at one; a ``config`` or ``model`` (a name or attribute so called, or ``type()`` of
  one: nopad's names for a model's config and the model); ``super()`` (nopad's only library class
  whose bases are transformers', the Trainer mixin, calls its private methods there);
- ``X.name = ...`` for any name, where ``X`` is a transformers module imported here or
  ``sys.modules["transformers..."]``: a global of transformers rebound.

Not counted: private names of nopad's own objects (``self._x``), torch's (``module._parameters``),
and names nopad marks transformers' functions with (``_nopad...``). The names the scan cannot see,
because the code reaches them by a string held in a table (the kernel globals, the Mamba2 hooks, the
markers read in model source), are checked against their tables below.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from nopad.packing.hf import compat

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("packing", "inference", "training", "dataloaders", "recipes", "assets")
HOLDERS = {"config", "model"}
CHECKERS = {"getattr", "hasattr", "setattr", "delattr"}


# ----------------------------------------------------------------------------- the scan
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_nopad")


def _imported(tree: ast.AST) -> set[str]:
    """The names this module binds to transformers modules or objects."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("transformers")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _transformers_module(node: ast.AST, imported: set[str]) -> bool:
    """A name imported from transformers, a chain rooted at one, or ``sys.modules["transformers..."]``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    if isinstance(node, ast.Subscript):
        key = node.slice
        return (
            ast.unparse(node.value) == "sys.modules"
            and isinstance(key, ast.Constant)
            and str(key.value).startswith("transformers")
        )
    return isinstance(node, ast.Name) and node.id in imported


def _holds_transformers(node: ast.AST, imported: set[str]) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        return node.func.id == "type" and bool(node.args) and _holds_transformers(node.args[0], imported)
    if isinstance(node, ast.Name) and node.id in HOLDERS:
        return True
    if isinstance(node, ast.Attribute) and node.attr in HOLDERS:
        return True
    return _transformers_module(node, imported)


def reached(source: str) -> set[str]:
    """The transformers names one module's source reaches into, by the rules of the module docstring."""
    tree = ast.parse(source)
    imported = _imported(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            found |= {a.name for a in node.names if _private(a.name)}
        elif isinstance(node, ast.Attribute):
            if _private(node.attr) and _holds_transformers(node.value, imported):
                found.add(node.attr)
            elif isinstance(node.ctx, ast.Store) and _transformers_module(node.value, imported):
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in CHECKERS
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and _holds_transformers(node.args[0], imported)
        ):
            found.add(node.args[1].value)
    return found


def library_modules():
    fence = ROOT / "training" / "trl"
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            if fence not in path.parents:
                yield path


LISTED = {touch.name.rsplit(".", 1)[-1] for touch in compat.TOUCHED}


def test_every_transformers_name_the_code_reaches_into_is_listed():
    unlisted = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in library_modules()
        for name in reached(path.read_text())
        if name not in LISTED
    }
    assert not unlisted, (
        "these modules reach into transformers by names packing/hf/compat.py does not list "
        f"(add each to TOUCHED, with how to check it): {sorted(unlisted)}"
    )


def test_the_scan_sees_the_known_uses():
    """Not vacuous: the uses the fence was written for are found, each where it is."""

    def at(module: str) -> set[str]:
        return reached((ROOT / module).read_text())

    assert "_attn_implementation" in at("packing/hf/attention.py") & at("packing/mixers/mamba2.py")
    assert "_is_stateful" in at("packing/mixers/support.py")
    assert "_prepare_inputs" in at("training/trainer.py")
    assert "use_kernel_func_from_hub_with_fallback" in at("packing/mixers/hf_kernels.py")
    sample = (
        "from transformers.utils import _private, logging\nimport transformers as t\n"
        "t.modeling_utils.hook = 1\nself._mine = model._theirs\nmodule._parameters\n"
        "getattr(type(model), '_flag')\nsuper()._step()\nlogging._level\nfn._nopad_mark = 1\n"
    )
    assert reached(sample) == {"_private", "hook", "_theirs", "_flag", "_step", "_level"}


def test_the_names_held_in_tables_are_listed():
    """Reached by a string, which the scan cannot follow: each table's names must be in the fence,
    with at least the parameters the code relies on."""
    from nopad.packing.mixers import hf_kernels, mamba2, sinks, support

    assert set(hf_kernels.GLOBAL_NAMES) <= LISTED
    assert mamba2.FAMILIES == compat.MAMBA2_FAMILIES
    listed = {(t.module, t.name): t.needs for t in compat.TOUCHED}
    for module, mixer in mamba2.FAMILIES.items():
        assert (module, mixer) in listed and (module, mamba2.MASK_HOOK) in listed
        for name, needed in (*mamba2.HOOK_PARAMETERS.items(), (mamba2.STEP_FUNCTION, mamba2.STEP_PARAMETERS)):
            assert set(needed) <= set(listed[module, name]), (module, name)
    needles = {n for t in compat.TOUCHED if t.how == compat.SOURCE for n in t.needs}
    assert set(support._ATTENTION_CALL_MARKERS) & needles and sinks.SINKS_ARGUMENT in needles


def test_each_listed_name_says_which_nopad_module_relies_on_it():
    def path(module: str):  # nopad.packing.hf.attention -> packing/hf/attention.py (the folder installs as nopad.*)
        return ROOT / (module.removeprefix("nopad.").replace(".", "/") + ".py")

    missing = [t for t in compat.TOUCHED if not path(t.by).is_file()]
    assert not missing, missing


# ----------------------------------------------------------------------------- the installed transformers
@pytest.fixture
def fresh(monkeypatch):
    """A process that has checked nothing yet, put back as it was after."""
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    compat.reset()
    yield
    compat.reset()


def test_the_installed_transformers_passes_every_check(fresh):
    assert compat.problems() == []
    compat.check()


def test_the_pin_in_pyproject_is_the_tested_range():
    pins = re.findall(r'"(transformers[<>=][^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert pins == [f"transformers{compat.TESTED_TRANSFORMERS}"], pins


def test_check_runs_once_per_process(fresh, monkeypatch):
    calls = []
    real = compat.problem
    monkeypatch.setattr(compat, "problem", lambda touch: calls.append(touch) or real(touch))
    compat.check()
    first = len(calls)
    compat.check()
    compat.check()
    assert first > 0 and len(calls) == first


def test_the_lazy_trainer_names_are_checked_once_its_module_is_imported(fresh, monkeypatch):
    import sys

    trainer = [t for t in compat.TOUCHED if t.module in compat.LAZY_MODULES]
    monkeypatch.delitem(sys.modules, "transformers.trainer", raising=False)
    compat.check()
    assert trainer and not set(trainer) & compat._checked
    monkeypatch.undo()
    import transformers.trainer  # noqa: F401

    compat.check()
    assert set(trainer) <= compat._checked


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("version", ["5.25.0", "5.40.0", "5.23.1", "6.0.0"])
def test_a_version_outside_the_tested_range_is_refused_in_one_line(fresh, monkeypatch, version):
    monkeypatch.setattr(compat, "installed_transformers", lambda: version)
    with pytest.raises(compat.UntestedTransformersError) as error:
        compat.check()
    message = str(error.value)
    assert "\n" not in message
    assert f"transformers{compat.TESTED_TRANSFORMERS}" in message and f"transformers {version}" in message
    assert compat.ALLOW_UNTESTED_ENV in message
    with pytest.raises(compat.UntestedTransformersError, match=re.escape(message)):
        compat.check()  # every later use is refused the same way


def test_an_untested_version_runs_when_allowed_if_its_names_match(fresh, monkeypatch, caplog):
    monkeypatch.setattr(compat, "installed_transformers", lambda: "5.25.0")
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="nopad.packing.hf.compat"):
        compat.check()
    assert "untested transformers 5.25.0" in caplog.text


def test_a_missing_name_or_changed_signature_is_refused_naming_it(fresh, monkeypatch):
    """Even with the escape hatch set: a difference is always an error, one line, naming it."""
    from transformers.integrations import hub_kernels
    from transformers.modeling_utils import PreTrainedModel

    def hook(func_name, package):  # internal_path gone
        return lambda fn: fn

    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.delattr(PreTrainedModel, "_is_stateful")
    monkeypatch.setattr(hub_kernels, "use_kernel_func_from_hub_with_fallback", hook)
    with pytest.raises(compat.UntestedTransformersError) as error:
        compat.check()
    message = str(error.value)
    assert "\n" not in message and "differs where nopad reaches into it" in message
    assert "transformers.modeling_utils.PreTrainedModel._is_stateful is gone" in message
    assert (
        "transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback takes no internal_path"
    ) in message


def test_changed_source_and_kernel_globals_are_named(monkeypatch):
    from transformers.models.bamba import modeling_bamba
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states, attention_mask=None):  # the layer's keyword arguments not handed on
        return modeling_llama.ALL_ATTENTION_FUNCTIONS["sdpa"](self, hidden_states)

    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size):  # not made by the kernel hook
        return hidden_states

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward)
    monkeypatch.setattr(modeling_bamba, "mamba2_chunk_scan", mamba2_chunk_scan)
    assert compat.problems() == [
        "transformers.models.llama.modeling_llama.LlamaAttention.forward no longer has '**kwargs'",
        "transformers.models.bamba.modeling_bamba.mamba2_chunk_scan is no longer made by the kernel hook",
    ]


def test_many_differences_are_named_three_then_counted(fresh, monkeypatch):
    monkeypatch.setattr(compat, "problems", lambda touches: [f"name {i} is gone" for i in range(5)])
    with pytest.raises(compat.UntestedTransformersError) as error:
        compat.check()
    message = str(error.value)
    assert "name 2 is gone (and 2 more: nopad.packing.hf.compat.problems())" in message and "name 3" not in message


def test_an_untested_transformers_is_refused_before_nopad_patches_it(fresh, monkeypatch):
    """The first use (registering the attention) refuses, and transformers stays as it was."""
    from transformers.integrations import hub_kernels

    from nopad.packing.hf import register_nopad_attention
    from nopad.packing.mixers import patches

    patches.uninstall()
    try:
        monkeypatch.setattr(compat, "installed_transformers", lambda: "5.40.0")
        own = hub_kernels.use_kernel_func_from_hub_with_fallback
        with pytest.raises(compat.UntestedTransformersError, match="this is transformers 5.40.0"):
            register_nopad_attention()
        assert hub_kernels.use_kernel_func_from_hub_with_fallback is own and not patches.installed()
    finally:
        monkeypatch.undo()
        compat.reset()
        patches.install()
