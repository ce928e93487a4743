"""A config's documentation, read from its dataclasses: ``--help`` (each key with type, default and
the comment beside its default) and the shipped ``recipes/configs/*.yaml`` (``python -m
nopad.recipes.config`` rewrites them; a test keeps them equal), so a default is written once."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import yaml

from nopad.recipes.config_types import _describe, _hints


def field_docs(cls) -> dict[str, str]:
    """``{field: its trailing comment}`` read from the dataclass source (and its bases'), so each
    field is documented once, beside its default, and ``--help`` shows that line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        for line in lines:
            match = re.match(r"\s+(\w+)\s*:[^#]*=[^#]*#\s*(.+)$", line)
            if match:
                docs[match.group(1)] = match.group(2).strip()
    return docs


def help_text(cls, prog: str, about: str = "") -> str:
    """``--help`` for a recipe: usage, then each section's keys with type, default and doc line."""
    out = [f"usage: {prog} [config.yaml] [section.key=value ...]", ""]
    if about:
        out += [about.strip(), ""]
    out += ["Every key below can be set in a YAML file or as section.key=value on the command line.", ""]
    out += _help_lines(cls, "")
    return "\n".join(out)


def _field_default(f: dataclasses.Field):
    """A field's default as declared, without building the section (whose check may import torch:
    ``--help`` must answer without it)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _help_lines(cls, prefix: str) -> list[str]:
    hints, docs = _hints(cls), field_docs(cls)
    lines, sections = [], []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            sections.append((f.name, hint))
            continue
        value = _field_default(f)
        shown = (
            yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            if not callable(value)
            else getattr(value, "__name__", str(value))
        )
        doc = docs.get(f.name, "")
        lines.append(f"  {prefix}{f.name} = {shown}   ({_describe(hint)})" + (f"  {doc}" if doc else ""))
        optional = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if optional:  # an optional section (model.lora): list its keys too
            sections.append((f.name, optional[0]))
    for name, hint in sections:
        doc = (hint.__dict__.get("__doc__") or "").split("\n\n")[0]
        doc = "" if doc.startswith(f"{hint.__name__}(") else " ".join(doc.split())  # dataclass's own
        lines += ["", f"{prefix}{name}:" + (f"  {doc}" if doc else "")]
        lines += _help_lines(hint, f"{prefix}{name}.")
    return lines


def render_yaml(cls, header: str = "") -> str:
    """``cls``'s defaults as a commented YAML file (each key with its field's comment), after the
    comment block ``header``. The shipped ``recipes/configs/<recipe>.yaml`` are this output
    (``python -m nopad.recipes.config`` rewrites them), so a default is written once, in the dataclass."""
    lines = [line for line in header.splitlines() if line.strip()]
    lines += _yaml_lines(cls, "")
    return "\n".join(lines) + "\n"


def _yaml_lines(cls, indent: str) -> list[str]:
    hints, docs, default = _hints(cls), field_docs(cls), cls()
    lines = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            lines += [f"{indent}{f.name}:", *_yaml_lines(hint, indent + "  ")]
            continue
        value = getattr(default, f.name)
        text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        entry = f"{indent}{f.name}: {text}"
        doc = docs.get(f.name)
        lines.append(f"{entry:<24} # {doc}" if doc else entry)
        optional = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if optional and value is None:  # an optional section that is off (model.lora): its keys, commented
            lines += [f"{indent}#{line[len(indent) :]}" for line in _yaml_lines(optional[0], indent + "  ")]
    return lines


def yaml_header(path: str | Path) -> str:
    """The leading comment block of a YAML file (what :func:`render_yaml` keeps)."""
    header = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    return "\n".join(header)


GENERATED_YAMLS = {
    "evaluate": "nopad.recipes.evaluate:EvaluateConfig",  # file stem -> its config class
    "grpo": "nopad.recipes.grpo_config:GRPORecipeConfig",
    "preprocess": "nopad.recipes.preprocess:PreprocessConfig",
    "sft": "nopad.recipes.sft_config:SFTRecipeConfig",
}


def write_yamls(directory: str | Path = Path(__file__).parent / "configs") -> list[Path]:
    """Rewrite the shipped YAMLs from their dataclasses (run after changing a default or comment)."""
    import importlib

    written = []
    for stem, target in GENERATED_YAMLS.items():
        module, _, name = target.partition(":")
        path = Path(directory) / f"{stem}.yaml"
        path.write_text(render_yaml(getattr(importlib.import_module(module), name), yaml_header(path)))
        written.append(path)
    return written
