"""Typed recipe configs: dataclasses that check themselves, read from YAML and ``key=value``
overrides.

Each recipe declares its config as a dataclass of sections (``SFTRecipeConfig.train.lr``); the defaults
live there and nowhere else (the shipped ``recipes/configs/*.yaml`` are generated from them with
their comments by ``python -m nopad.recipes.config``, and a test keeps the two equal). Loading checks
every value against its field's type, so a typo (``rollout.max_token=8``) or a wrong value
(``train.lr=abc``) is an error naming the key before anything is built, never a silently ignored
setting or a TypeError deep inside the optimizer.

This module reads configs (YAML files, ``key=value`` overrides, a recipe's command line); the typed
sections are :mod:`nopad.recipes.config_types`, ``--help`` and the YAMLs :mod:`nopad.recipes.config_docs`, the
sections the recipes share :mod:`nopad.recipes.config_sections` and the logging :mod:`nopad.recipes.logs`. The
names a recipe needs are re-exported here, so a recipe imports its config from one place.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import yaml

from nopad.recipes.config_docs import GENERATED_YAMLS, help_text, render_yaml, write_yamls, yaml_header
from nopad.recipes.config_sections import (
    MAX_LEARNING_RATE,
    AccelerateConfig,
    ChatModelConfig,
    GeneratorConfig,
    LoRAConfig,
    ModelConfig,
    StepCheckpointConfig,
    check_learning_rate,
    check_optimizer,
    check_sampling,
)
from nopad.recipes.config_types import ConfigError, Section, from_dict
from nopad.recipes.logs import NOISY_LOGGERS, setup_logging

__all__ = [
    "GENERATED_YAMLS",
    "MAX_LEARNING_RATE",
    "NOISY_LOGGERS",
    "AccelerateConfig",
    "ChatModelConfig",
    "ConfigError",
    "GeneratorConfig",
    "LoRAConfig",
    "ModelConfig",
    "Section",
    "StepCheckpointConfig",
    "check_learning_rate",
    "check_optimizer",
    "check_sampling",
    "from_dict",
    "help_text",
    "load_config",
    "parse_cli",
    "parse_override",
    "render_yaml",
    "setup_logging",
    "with_overrides",
    "write_yamls",
    "yaml_header",
]

C = TypeVar("C")


def _refuse_repeated_keys(node, path: Path, prefix: str = "") -> None:
    """A key written twice in one YAML mapping is an error naming it and both lines: PyYAML keeps
    the last one without a word, so a second ``train:`` section would drop the first one's keys."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(item, path, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict = {}
    for key_node, value_node in node.value:
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(
                key,
                f"is written twice in {path} (lines {seen[key]} and {line}); keep one: "
                "the second would replace the first",
            )
        seen[key] = line
        _refuse_repeated_keys(value_node, path, f"{key}.")


def _yaml_error(err: yaml.YAMLError, where: str) -> ValueError:
    """PyYAML's error with ``where`` (the file, or the setting) and the line in place of its
    ``"<unicode string>"``; a tab, which YAML never takes for indentation, is said so."""
    mark = getattr(err, "problem_mark", None)
    at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    context = getattr(err, "context", None)
    hint = (
        "YAML indents with spaces, never tabs: replace the tab with spaces"
        if "'\\t'" in problem
        else "fix the YAML there"
    )
    return ValueError(f"{where}{at}: {problem}{f' ({context})' if context else ''}; {hint}")


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        _refuse_repeated_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise _yaml_error(err, f"config file {path}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping at the top level")
    return data


def _merge(base: dict, update: Mapping) -> dict:
    """``base`` updated in place by ``update``, section by section (a nested key replaces one field)."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = _merge({}, value) if isinstance(value, Mapping) else value
    return base


def parse_override(text: str) -> dict:
    """``"a.b=3"`` -> ``{"a": {"b": 3}}``; the value is parsed as YAML (numbers, null, true)."""
    if "=" not in text:
        raise ValueError(
            f"{text} has no value: write {text}=<value> (settings are section.key=value; a "
            "config file comes first and ends in .yaml)"
        )
    dotted, _, raw = text.partition("=")
    if not all(part.strip() for part in dotted.split(".")):
        what = "an empty part in its key" if dotted.strip() else "an empty key before the ="
        raise ValueError(f"{text!r} has {what}: write settings as section.key=value; --help lists the keys")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise _yaml_error(err, f"the value of {dotted.strip()} ({raw!r})") from None
    if isinstance(value, str):
        try:  # YAML 1.1 reads "1e-5" as a string
            value = float(value)
        except ValueError:
            pass
    out: dict = value
    for part in reversed(dotted.strip().split(".")):
        out = {part: out}
    return out


def _overrides(overrides: Sequence[str] | Mapping) -> dict:
    if isinstance(overrides, Mapping):
        return _merge({}, overrides)
    merged: dict = {}
    for text in overrides:
        _merge(merged, parse_override(text))
    return merged


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] | Mapping = ()) -> C:
    """``cls``'s defaults, updated by the YAML file ``path`` (if any) and then by the overrides
    (``["train.steps=3"]`` or a nested dict), checked."""
    data = _read_yaml(path) if path is not None else {}
    return from_dict(cls, _merge(data, _overrides(overrides)))


def parse_cli(cls: type[C], argv: Sequence[str] | None, prog: str, about: str = "") -> C:
    """The config of a recipe's command line ``[config.yaml] [section.key=value ...]``.

    ``-h``/``--help`` prints every section and key (type, default, one line) and exits 0; a wrong
    setting is one line on stderr and exit code 2, as argparse does, not a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(cls, prog, about))
        raise SystemExit(0)
    path = argv.pop(0) if argv and _is_config_file(argv[0]) else None
    try:
        _refuse_repeated_settings(argv)
        return load_config(cls, path, argv)
    except (ConfigError, FileNotFoundError, ValueError, yaml.YAMLError) as err:
        print(f"{prog}: error: {err} (see {prog} --help)", file=sys.stderr)
        raise SystemExit(2) from None


def _refuse_repeated_settings(argv: Sequence[str]) -> None:
    """A key given twice on the command line is an error, as in a YAML file: the second value
    would silently replace the first (a README line with one's own setting appended)."""
    seen: dict[str, str] = {}
    for text in argv:
        key = text.partition("=")[0].strip()
        if key in seen:
            raise ConfigError(
                key,
                f"is given twice on the command line ({seen[key]} and {text}); keep one: "
                "the second would replace the first",
            )
        seen[key] = text


def _is_config_file(arg: str) -> bool:
    """The first argument is the config file unless it reads as a setting: ``train.max_steps``
    alone (a forgotten ``=value``) is that error, not "config file 'train.max_steps' does not exist"."""
    return "=" not in arg and (arg.endswith((".yaml", ".yml")) or Path(arg).exists() or "/" in arg)


def with_overrides(cfg: C, overrides: Sequence[str] | Mapping) -> C:
    """A copy of ``cfg`` with the overrides applied, checked again."""
    return from_dict(type(cfg), _merge(cfg.to_dict(), _overrides(overrides)))


if __name__ == "__main__":  # python -m nopad.recipes.config: regenerate recipes/configs/*.yaml
    for written in write_yamls():
        print(f"wrote {written}")
