"""The recipes' command line: ``-h``/``--help`` for every recipe and console script,
generated from the config dataclasses; a config error is one line on stderr and exit code 2."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {
    "nopad.recipes.preprocess": "capacity = 2048   (an integer)  tokens per packed row",
    "nopad.recipes.sft": "  train.max_steps = null   (an integer or null)  optimizer steps;",
    "nopad.recipes.grpo": "  rollout.num_generations = 8   (an integer)  completions per prompt (the GRPO group)",
    "nopad.recipes.evaluate": "  model.chat_template = auto   (true, false or 'auto')",
}


def _scripts() -> dict[str, str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("module", sorted(RECIPES))
def test_help_lists_every_key_with_default_type_and_doc(module, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main([flag])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {module} [config.yaml] [section.key=value ...]")
    assert RECIPES[module] in out


@pytest.mark.parametrize("script", ["nopad-preprocess", "nopad-sft", "nopad-grpo", "nopad-evaluate", "nopad-demo"])
def test_every_console_script_answers_help(script, monkeypatch, capsys):
    module, _, name = _scripts()[script].partition(":")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), name)()
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_help_covers_every_field_of_the_config():
    import dataclasses

    from nopad.recipes.config import help_text
    from nopad.recipes.sft_config import SFTRecipeConfig as SFTConfig

    text = help_text(SFTConfig, "nopad.recipes.sft")
    for section in dataclasses.fields(SFTConfig):
        for f in dataclasses.fields(getattr(SFTConfig(), section.name)):
            assert f"  {section.name}.{f.name} = " in text


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["train.lr=abc"],
            "nopad.recipes.sft: error: train.lr must be a number, got 'abc' (see nopad.recipes.sft --help)",
        ),
        (["train.max_step=3"], "nopad.recipes.sft: error: train.max_step is not a config key here; known keys: "),
        (["missing.yaml"], "nopad.recipes.sft: error: config file 'missing.yaml' does not exist"),
        (["train.max_steps"], "nopad.recipes.sft: error: train.max_steps has no value: write train.max_steps=<value>"),
        (["model.path=tiny:llama", "train.max_steps"], "nopad.recipes.sft: error: train.max_steps has no value: "),
    ],
)
def test_a_config_error_is_one_line_and_exit_code_2(args, message, capsys):
    from nopad.recipes.sft import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_a_config_error_from_the_shell_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "nopad.recipes.evaluate", "data.num_prompts=0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "nopad.recipes.evaluate: error: data.num_prompts must be an integer >= 1 or null, got 0 "
        "(see nopad.recipes.evaluate --help)"
    ]


def test_the_demo_takes_no_arguments(monkeypatch, capsys):
    from nopad.recipes import demo

    monkeypatch.setattr(sys, "argv", ["nopad-demo", "steps=3"])
    with pytest.raises(SystemExit) as exit_:
        demo.main()
    assert exit_.value.code == 2 and "takes no arguments" in capsys.readouterr().err


def test_the_shipped_yamls_are_generated_from_the_dataclasses():
    """A default is written once, in the dataclass: the YAMLs are `python -m nopad.recipes.config`'s
    output, and they load back to the defaults."""
    import importlib

    from nopad.recipes.config import GENERATED_YAMLS, load_config, render_yaml, yaml_header

    for stem, target in GENERATED_YAMLS.items():
        module, _, name = target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        path = ROOT / "recipes" / "configs" / f"{stem}.yaml"
        assert path.read_text() == render_yaml(cls, yaml_header(path)), f"python -m nopad.recipes.config ({path})"
        assert load_config(cls, path) == cls()


def test_setup_logging_quiets_library_noise_but_not_the_users_warnings(monkeypatch):
    """Accelerate's per-checkpoint lines and deprecation FutureWarnings from the libraries
    (or nopad's calls of them) are quiet; a user's own FutureWarning and any other warning still show."""
    import logging
    import warnings

    from nopad.recipes.config import NOISY_LOGGERS, setup_logging

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            setup_logging()
            for module, category in [
                ("transformers.modeling_utils", FutureWarning),
                ("nopad.training.trainer", FutureWarning),
                ("torch.nn.modules", UserWarning),
                ("my_rewards", FutureWarning),
                ("__main__", FutureWarning),
            ]:
                warnings.warn_explicit(f"from {module}", category, "x.py", 1, module=module)
        assert [str(w.message) for w in seen] == ["from torch.nn.modules", "from my_rewards", "from __main__"]
        assert all(not logging.getLogger(n).isEnabledFor(logging.INFO) for n in NOISY_LOGGERS)
        import torch

        if not torch.cuda.is_available():  # DeepSpeed picks the CPU without its warning every run
            assert os.environ["DS_ACCELERATOR"] == "cpu"
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "train:\n  lr: 1.0e-4\nmodel:\n  path: tiny:llama\ntrain:\n  max_steps: 3\n",
            "train is written twice in {path} (lines 1 and 5); keep one",
        ),
        (
            "train:\n  lr: 1.0e-4\n  max_steps: 3\n  lr: 2.0e-4\n",
            "train.lr is written twice in {path} (lines 2 and 4); keep one",
        ),
    ],
)
def test_a_key_or_section_written_twice_is_an_error_naming_both_lines(tmp_path, text, message, capsys):
    """PyYAML keeps the last one silently (a second train: section dropped the first's keys)."""
    from nopad.recipes.sft import main

    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        main([str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("nopad.recipes.sft: error: " + message.format(path=path)) and err.count("\n") == 1


def test_a_key_given_twice_on_the_command_line_is_an_error_naming_both(capsys):
    """The last ``key=value`` used to win silently; a key twice in a YAML file was already refused."""
    from nopad.recipes.sft import main

    with pytest.raises(SystemExit) as exit_:
        main(["train.lr=1e-4", "model.path=tiny:llama", "train.lr=2e-4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            "nopad.recipes.sft: error: train.lr is given twice on the command line (train.lr=1e-4 "
            "and train.lr=2e-4); keep one"
        )
        and err.count("\n") == 1
    )


def test_programmatic_overrides_still_let_a_later_one_win():
    """``load_config(cls, None, base + extra)`` is how scripts and tests build on a base list."""
    from nopad.recipes.config import load_config
    from nopad.recipes.sft_config import SFTRecipeConfig

    cfg = load_config(SFTRecipeConfig, None, ["train.lr=1e-4", "model.path=tiny:llama", "train.lr=2e-4"])
    assert cfg.train.lr == 2e-4 and cfg.model.path == "tiny:llama"


@pytest.mark.parametrize(
    "text, message",
    [
        ("train:\n  lr: [1\n", "config file {path}, line 3, column 1: expected ',' or ']', but got '<stream end>'"),
        (
            "train:\n\tlr: 1.0\n",
            "config file {path}, line 2, column 1: found character '\\t' that cannot start "
            "any token (while scanning for the next token); YAML indents with spaces, "
            "never tabs",
        ),
    ],
)
def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, text, message, capsys):
    """PyYAML used to name the file "<unicode string>"."""
    from nopad.recipes.sft import main

    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        main([str(path)])
    err = capsys.readouterr().err
    assert err.startswith("nopad.recipes.sft: error: " + message.format(path=path)), err
    assert "<unicode string>" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "arg, message",
    [
        ("=5", "'=5' has an empty key before the =: write settings as section.key=value; --help lists the keys"),
        ("train.=5", "'train.=5' has an empty part in its key: write settings as section.key=value"),
        ("train.lr=[1", "the value of train.lr ('[1'), line 1, column 3: expected ',' or ']'"),
    ],
)
def test_an_empty_key_or_a_bad_value_says_what_to_write(arg, message, capsys):
    from nopad.recipes.sft import main

    with pytest.raises(SystemExit):
        main([arg])
    err = capsys.readouterr().err
    assert err.startswith("nopad.recipes.sft: error: " + message), err
    assert "<unicode string>" not in err


def _one_line_error(fn, capsys) -> str:
    from nopad.recipes.cli import run_recipe

    with pytest.raises(SystemExit) as exit_:
        run_recipe(fn, "nopad.recipes.sft")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("nopad.recipes.sft: error: ") and err.endswith("(NOPAD_DEBUG=1 shows the traceback)\n")
    return err


def test_errors_nopad_raises_on_purpose_reach_the_user_as_one_line(tmp_path, monkeypatch, capsys):
    """A NaN reward, a run directory in use, a truncated model file, a missing peft, an
    adapter that does not match: each message already says what to do; no traceback in front."""
    import json

    from nopad.recipes.models import load_model
    from nopad.recipes.sft_config import SFTModelConfig
    from nopad.training.checkpoint import LOCK_FILE
    from nopad.training.lora import apply_lora
    from nopad.training.nonfinite import reward_value
    from nopad.training.run_dir import claim_run_dir

    def nan_reward():
        return reward_value(float("nan"), nan_reward, "step 0, sample 3")

    assert "nan_reward returned nan for step 0, sample 3" in _one_line_error(nan_reward, capsys)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": "here", "run": "r1"}))
    assert "is in use by another run (pid" in _one_line_error(lambda: claim_run_dir(tmp_path / "run"), capsys)
    model, _ = load_model(SFTModelConfig(path="tiny:llama"))
    model.save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()  # (transformers' "Writing model shards" bar)
    message = _one_line_error(lambda: load_model(SFTModelConfig(path=str(tmp_path / "model"))), capsys)
    assert "could not load the model from model.safetensors" in message and "truncated" in message
    with pytest.raises(ValueError):  # (a test of the case below: the adapter's target is not in the model)
        apply_lora(model, rank=2, alpha=4, dropout=0.0, target_modules=["qkv"], base="tiny:llama")
    message = _one_line_error(
        lambda: apply_lora(model, rank=2, alpha=4, dropout=0.0, target_modules=["qkv"], base="tiny:llama"), capsys
    )
    assert "model.lora.target_modules: qkv not found in the model" in message
    monkeypatch.setitem(sys.modules, "peft", None)
    message = _one_line_error(
        lambda: apply_lora(model, rank=2, alpha=4, dropout=0.0, target_modules="all-linear", base="tiny:llama"), capsys
    )
    assert "runs through peft, which is not installed: pip install" in message


def test_other_errors_and_nopad_debug_keep_the_traceback(monkeypatch):
    from nopad.recipes.cli import raised_on_purpose, run_recipe
    from nopad.recipes.config import parse_override
    from nopad.training.nonfinite import reward_value

    def not_nopads():
        raise ValueError("a user's reward function failing")

    with pytest.raises(ValueError, match="a user's reward"):
        run_recipe(not_nopads, "nopad.recipes.sft")
    with pytest.raises(TypeError):  # nopad's own line, failing by accident, is not "on purpose"
        run_recipe(lambda: parse_override(5), "nopad.recipes.sft")
    try:
        int("x")
    except ValueError as err:
        assert not raised_on_purpose(err)
    monkeypatch.setenv("NOPAD_DEBUG", "1")
    with pytest.raises(RuntimeError, match="returned nan"):
        run_recipe(lambda: reward_value(float("nan"), len, "x"), "nopad.recipes.sft")


def test_a_deliberate_error_from_the_shell_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-m", "nopad.recipes.evaluate", f"model.path={tmp_path / 'model'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    model = tmp_path / "model"
    assert last.startswith(f"nopad.recipes.evaluate: error: model.path={model}: could not load the model")
    assert "Traceback" not in proc.stderr


HEAVY = ("torch", "transformers", "datasets", "accelerate", "trl", "peft", "deepspeed")


@pytest.mark.parametrize("script", ["nopad-preprocess", "nopad-sft", "nopad-grpo", "nopad-evaluate", "nopad-demo"])
@pytest.mark.parametrize("how", ["python -m", "console script"])
def test_help_imports_neither_torch_nor_transformers(script, how):
    """--help used to take 41-62 s on a loaded 2-core machine, importing torch and transformers to
    print text. Checked by what is imported (python -X importtime), not by a time."""
    module, _, name = _scripts()[script].partition(":")
    if how == "python -m":
        args = ["-m", module, "--help"]
    else:
        args = ["-c", f"import sys; sys.argv = [{script!r}, '--help']; from {module} import {name}; {name}()"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & set(HEAVY), f"{script} --help imported {sorted(imported & set(HEAVY))}"
