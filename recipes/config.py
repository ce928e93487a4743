"""Typed recipe configs: dataclasses that check themselves, read from YAML and ``key=value``
overrides.

Each recipe declares its config as a dataclass of sections (``SFTRecipeConfig.train.lr``); the defaults
live there and nowhere else (the shipped ``recipes/configs/*.yaml`` are generated from them with
their comments by ``python -m recipes.config``, and a test keeps the two equal). Loading checks
every value against its field's type, so a typo (``rollout.max_token=8``) or a wrong value
(``train.lr=abc``) is an error naming the key before anything is built, never a silently ignored
setting or a TypeError deep inside the optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

C = TypeVar("C")
logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config value that is wrong; ``key`` is its dotted name (``train.lr``)."""

    def __init__(self, key: str, detail: str):
        super().__init__(f"{key} {detail}")
        self.key, self.detail = key, detail

    def under(self, section: str) -> ConfigError:
        return ConfigError(f"{section}.{self.key}", self.detail)


class Section:
    """Base of every config dataclass: ``__post_init__`` converts and type-checks each field by its
    annotation (a nested mapping becomes its section's dataclass), then runs ``check()``."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, hints[f.name], getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Checks that span fields or need ranges; raise :class:`ConfigError` naming the field."""

    def at_least(self, name: str, minimum: int | float) -> None:
        """``name`` must be ``>= minimum`` (``None`` passes where the type allows it)."""
        value = getattr(self, name)
        if value is not None and value < minimum:
            optional = type(None) in typing.get_args(_hints(type(self))[name])
            kind = "an integer" if isinstance(value, int) else "a number"
            or_null = " or null" if optional else ""
            raise ConfigError(name, f"must be {kind} >= {minimum}{or_null}, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.cache
def _hints(cls) -> dict:
    """The field annotations of ``cls``, resolved (they are strings under postponed evaluation)."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[C], data: Mapping) -> C:
    """``cls`` built from a (nested) mapping; keys it does not have are errors naming them."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            raise ConfigError(str(key), f"is not a config key here; known keys: {', '.join(names)}")
    return cls(**data)


def _describe(hint) -> str:
    """``bool | Literal["auto"]`` -> ``"true, false or 'auto'"``, for error messages."""
    words = []
    for option in typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,):
        if typing.get_origin(option) is Literal:
            words += [repr(a) for a in typing.get_args(option)]
        elif dataclasses.is_dataclass(option):
            words.append("a section")
        else:
            words += {bool: ["true", "false"], int: ["an integer"], float: ["a number"], str: ["a string"],
                      type(None): ["null"]}.get(option, [getattr(option, "__name__", str(option))])
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _coerce(name: str, hint, value):
    """``value`` checked (and converted: an int to float, a mapping to its section) for a field
    annotated ``hint``; a :class:`ConfigError` naming ``name`` otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(name, f"is a section; set its fields as {name}.<field>=...")
        try:
            return from_dict(hint, value)
        except ConfigError as err:
            raise err.under(name) from None
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            if dataclasses.is_dataclass(option) and isinstance(value, Mapping):
                return _coerce(name, option, value)  # an optional section: its own error, naming its key
            try:
                return _coerce(name, option, value)
            except ConfigError:
                pass
        raise ConfigError(name, f"must be {_describe(hint)}, got {value!r}")
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ConfigError(name, f"must be {_describe(hint)}, got {value!r}")
    if origin is Callable or hint is Callable:
        if callable(value):
            return value
        raise ConfigError(name, f"must be a function, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(name, f"must be true or false, got {value!r}")
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads ``lr: 1e-5`` (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if hint in (int, float):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if hint is int and number and float(value).is_integer():
            return int(value)
        if hint is float and number:
            return float(value)
        raise ConfigError(name, f"must be {'an integer' if hint is int else 'a number'}, got {value!r}")
    if hint is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # a directory named 2024 reads as a number in YAML
        if isinstance(value, str):
            return value
        raise ConfigError(name, f"must be a string, got {value!r}")
    raise TypeError(f"internal: config field {name} has an annotation the loader does not know: {hint}")


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
            raise ConfigError(key, f"is written twice in {path} (lines {seen[key]} and {line}); keep one: "
                              "the second would replace the first")
        seen[key] = line
        _refuse_repeated_keys(value_node, path, f"{key}.")


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    _refuse_repeated_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
    data = yaml.safe_load(text) or {}
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
        raise ValueError(f"{text} has no value: write {text}=<value> (settings are section.key=value; a "
                         "config file comes first and ends in .yaml)")
    dotted, _, raw = text.partition("=")
    value = yaml.safe_load(raw) if raw.strip() else None
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
        return load_config(cls, path, argv)
    except (ConfigError, FileNotFoundError, ValueError, yaml.YAMLError) as err:
        print(f"{prog}: error: {err} (see {prog} --help)", file=sys.stderr)
        raise SystemExit(2) from None


def _is_config_file(arg: str) -> bool:
    """The first argument is the config file unless it reads as a setting: ``train.max_steps``
    alone (a forgotten ``=value``) is that error, not "config file 'train.max_steps' does not exist"."""
    return "=" not in arg and (arg.endswith((".yaml", ".yml")) or Path(arg).exists() or "/" in arg)


NOISY_LOGGERS = ("accelerate.checkpointing",  # 8 "saved ... to ..." lines per checkpoint
                 "accelerate.accelerator",  # "loading states from ..." per resume
                 "DeepSpeed", "deepspeed")  # its CPU-accelerator notice in every run, its config dumps
# where a deprecation FutureWarning is for nopad's developers, not for the user of a recipe: raised in
# the libraries underneath, or attributed to nopad's own call of them
QUIET_FUTURE_WARNINGS = (r"(torch|transformers|accelerate|deepspeed|trl|peft|datasets|huggingface_hub|"
                         r"safetensors|packing|dataloaders|inference|training|recipes|assets)(\..*)?$")


def setup_logging(fmt: str = "%(asctime)s %(name)s: %(message)s") -> None:
    """The recipes' console logging: INFO for nopad, warnings only from the libraries whose INFO is
    noise to a user, and no deprecation FutureWarnings from the libraries underneath or nopad's calls
    of them (the recipes call them as documented). Every other warning still shows, a FutureWarning
    from the user's own code (a reward module) included."""
    import logging
    import warnings

    logging.basicConfig(level=logging.INFO, format=fmt)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=QUIET_FUTURE_WARNINGS)
    import torch

    if not torch.cuda.is_available():  # what DeepSpeed picks anyway, without its warning every run
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


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
        shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip() \
            if not callable(value) else getattr(value, "__name__", str(value))
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
    (``python -m recipes.config`` rewrites them), so a default is written once, in the dataclass."""
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
            lines += [f"{indent}#{line[len(indent):]}" for line in _yaml_lines(optional[0], indent + "  ")]
    return lines


def yaml_header(path: str | Path) -> str:
    """The leading comment block of a YAML file (what :func:`render_yaml` keeps)."""
    header = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    return "\n".join(header)


GENERATED_YAMLS = {"evaluate": "recipes.evaluate:EvaluateConfig",  # file stem -> its config class
                   "grpo": "recipes.grpo_config:GRPORecipeConfig",
                   "preprocess": "recipes.preprocess:PreprocessConfig",
                   "sft": "recipes.sft_config:SFTRecipeConfig"}


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


def with_overrides(cfg: C, overrides: Sequence[str] | Mapping) -> C:
    """A copy of ``cfg`` with the overrides applied, checked again."""
    return from_dict(type(cfg), _merge(cfg.to_dict(), _overrides(overrides)))


# ------------------------------------------------------------------------- sections the recipes share
DType = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass
class ModelConfig(Section):
    """Which model: ``smollm2`` (the embedded SmolLM2-135M-Instruct), ``tiny:<family>`` (a tiny
    random-weight model, for tests), or a local Hugging Face model directory (a training run's
    output directory means its newest checkpoint)."""

    path: str | None = "smollm2"  # smollm2 (embedded), tiny:llama (tests), a model or run directory
    dtype: DType = "float32"  # float32 | bfloat16 | float16
    tool_template: str | None = None  # a chat template with tool calls: smollm2 (nopad's) or a .jinja file


@dataclasses.dataclass
class LoRAConfig(Section):
    """LoRA through peft: the model is frozen and an adapter of this rank trains on the target
    modules; checkpoints hold the adapter alone (with the base it applies to recorded)."""

    rank: int = 8  # the adapter's rank r
    alpha: float = 16.0  # scaling alpha (the update is scaled by alpha / rank)
    dropout: float = 0.0  # on the adapter's input; > 0: GRPO's rollouts differ from the trainer's
    target_modules: str = "all-linear"  # all-linear, or comma-separated module names: q_proj,v_proj

    def check(self) -> None:
        self.at_least("rank", 1)
        if not self.alpha > 0:
            raise ConfigError("alpha", f"must be a number > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("dropout", f"must be a number in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ConfigError("target_modules", "is empty; use all-linear or module names like q_proj,v_proj")

    @property
    def targets(self) -> str | list[str]:
        """peft's ``target_modules``: ``"all-linear"`` or the list of names."""
        if self.target_modules.strip() == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.target_modules.split(",") if name.strip()]


@dataclasses.dataclass
class ChatModelConfig(ModelConfig):
    """A model that reads prompts: ``chat_template`` true renders them with the tokenizer's chat
    template (an error if it has none), false feeds raw text, ``auto`` uses the template if any."""

    chat_template: bool | Literal["auto"] = "auto"  # true | false (raw text) | auto (if it has one)


@dataclasses.dataclass
class GeneratorConfig(Section):
    """The in-flight generator's KV cache and step budget (:class:`inference.Generator`)."""

    block_size: int | None = None  # null: the library's rule (packing.attention.paged_block_size)
    num_blocks: int = 1024  # KV cache blocks
    max_num_seqs: int = 64  # sequences in flight at once
    max_num_batched_tokens: int = 1024  # tokens per generator step (prefill chunks included)

    def check(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            self.at_least(name, 1)

    @property
    def smallest_block_size(self) -> int:
        """``block_size``, or the smallest the library's rule picks (16; 256 where a backend reads
        only 256-token pages): a KV-capacity check in blocks made with it holds for either."""
        return self.block_size or 16


@dataclasses.dataclass
class AccelerateConfig(Section):
    """``deepspeed_config``: a DeepSpeed JSON (or launch with ``accelerate launch``); ``log_with``:
    Accelerate trackers (tensorboard, wandb, all) for the run's curves."""

    deepspeed_config: str | None = None  # a DeepSpeed JSON (recipes/configs/deepspeed_*.json)
    log_with: str | None = None  # trackers for the curves: tensorboard | wandb | all


MAX_LEARNING_RATE = 1.0  # Adam's update is ~lr per step: above this the weights only blow up


def check_learning_rate(lr: float) -> None:
    """``train.lr`` must be in (0, :data:`MAX_LEARNING_RATE`]: ``lr=1e38`` overflowed inside Adam and
    ``lr=0`` trains nothing, both without a word."""
    if not 0 < lr <= MAX_LEARNING_RATE:
        raise ConfigError("lr", f"must be a number in (0, {MAX_LEARNING_RATE:g}], got {lr!r} (fine-tuning "
                          "uses about 1e-6 to 1e-3)")


def check_sampling(**settings) -> None:
    """Sampling settings (``temperature``, ``top_p``, ``max_tokens``...) checked by the rule the
    generator applies (:class:`inference.SamplingParams`), when the config is built: a
    ``temperature=-1`` is an error naming the key before the model loads, not minutes later."""
    from inference.sampling_params import SamplingParams

    try:
        SamplingParams(**settings)
    except ValueError as err:  # SamplingParams' messages start with the field's name
        name, _, detail = str(err).partition(" ")
        raise ConfigError(name, detail) from None


if __name__ == "__main__":  # python -m recipes.config: regenerate recipes/configs/*.yaml
    for written in write_yamls():
        print(f"wrote {written}")
