"""The user's pipeline end to end on a tiny model, as the README writes it: chat JSONL ->
nopad.recipes.preprocess -> nopad.recipes.sft (1 process; slow: 2-process DDP and DeepSpeed ZeRO-2 through the
README's launch lines) -> nopad.recipes.evaluate on the checkpoint -> nopad.recipes.grpo from it -> evaluate
again. Each stage's outputs are checked, and the packed SFT loss must be the per-document loss."""

import importlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F

from tests.support import launch

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROBLEMS = [(a, b) for a in range(2, 8) for b in range(1, 4)]  # 18 conversations


def _byte_tokenizer():
    """A byte-level chat tokenizer (259 tokens) built in code: no download, real chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i + 3 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny model directory, a chat JSONL, a prompt set, and the preprocessed (packed) data."""
    import transformers

    from nopad.recipes.preprocess import main as preprocess

    root = tmp_path_factory.mktemp("pipeline")
    tokenizer = _byte_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    chats = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]}
        for a, b in PROBLEMS
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    prompts = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in PROBLEMS[:4]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    packed = preprocess(
        [f"input={root / 'chat.jsonl'}", f"output={root / 'packed_chat'}", "capacity=256", f"tokenizer={root / 'base'}"]
    )
    return root, packed, chats


def _per_document_loss(model_dir: Path, chats) -> float:
    """Mean loss over every assistant token, each conversation run alone (no packing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nopad.inference.chat import tokenize_conversation

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    total, count = 0.0, 0
    with torch.no_grad():
        for chat in chats:
            ids, labels = tokenize_conversation(tok, chat["messages"])
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
    return total / count


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _sft_args(root: Path, out: Path) -> list[str]:
    # one micro-batch holds the whole epoch, one optimizer step per epoch: the first step's loss is
    # the mean over every assistant token at the initial weights
    return [
        f"model.path={root / 'base'}",
        f"data.source={root / 'packed_chat'}",
        "data.tokens_per_batch=2048",
        "train.grad_accum=1",
        "train.epochs=3",
        "train.lr=3.0e-3",
        "train.progress=false",
        f"checkpoint.output_dir={out}",
    ]


def _evaluate(model_dir: Path, root: Path, out: str) -> dict:
    from nopad.recipes.evaluate import main as evaluate

    result = evaluate(
        [
            f"model.path={model_dir}",
            f"data.path={root / 'prompts.jsonl'}",
            "sampling.max_tokens=6",
            "generator.num_blocks=64",
            f"output={root / out}",
        ]
    )
    lines = [json.loads(x) for x in (root / out).read_text().splitlines()]
    assert result["num_prompts"] == len(lines) == 4 and result["completion_tokens"] > 0
    assert [x["answer"] for x in lines] == [str(a + b) for a, b in PROBLEMS[:4]]
    return result


def test_preprocess_sft_evaluate_grpo_evaluate(inputs):
    from transformers import AutoModelForCausalLM

    from nopad.recipes.grpo import main as grpo
    from nopad.recipes.sft import main as sft

    root, packed, chats = inputs
    # preprocess: rows of several conversations, with their boundaries
    saved = datasets.load_from_disk(str(root / "packed_chat"))
    assert "seq_lengths" in saved.column_names and len(saved) == len(packed) < len(chats)
    assert sum(map(len, saved["seq_lengths"])) == len(chats)
    assert [sum(n) for n in saved["seq_lengths"]] == [len(ids) for ids in saved["input_ids"]]

    # SFT, one process: documents stay apart (packed loss == per-document loss), and it learns
    expected = _per_document_loss(root / "base", chats)
    result = sft(_sft_args(root, root / "sft"))
    _reset_accelerate()
    assert result["steps"] == 3 and result["deepspeed_engine"] is False
    assert result["losses"][0] == pytest.approx(expected, rel=1e-4)
    assert result["losses"][-1] < result["losses"][0]
    checkpoint = Path(result["checkpoint"])
    assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer.json").is_file()
    sft_model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    base_model = AutoModelForCausalLM.from_pretrained(str(root / "base"))
    assert not torch.equal(sft_model.lm_head.weight, base_model.lm_head.weight)

    # evaluate the checkpoint, GRPO from it, evaluate GRPO's output
    _evaluate(checkpoint, root, "eval_sft.jsonl")
    history = grpo(
        [
            f"model.path={checkpoint}",
            f"task.prompts={root / 'prompts.jsonl'}",
            "reward=tests.recipes.test_recipes_grpo:ids_checksum_reward",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=4",
            "rollout.max_tokens=6",
            "generator.num_blocks=64",
            "train.steps=2",
            "train.lr=1.0e-3",
            f"output_dir={root / 'grpo'}",
        ]
    )
    _reset_accelerate()
    assert [h["step"] for h in history] == [0, 1] and any(h["grad_norm"] > 0 for h in history)
    assert len((root / "grpo" / "metrics.jsonl").read_text().splitlines()) == 2
    grpo_model = AutoModelForCausalLM.from_pretrained(str(root / "grpo"))
    assert not torch.equal(grpo_model.lm_head.weight, sft_model.lm_head.weight)
    _evaluate(root / "grpo", root, "eval_grpo.jsonl")


def with_settings(words: list[str], settings: list[str] | tuple[str, ...]) -> list[str]:
    """A README line's words with the test's ``key=value`` settings in place of its own for the same
    keys (a key given twice on the command line is an error)."""
    keys = {s.partition("=")[0] for s in settings}
    return [w for w in words if "=" not in w or w.partition("=")[0] not in keys] + list(settings)


def readme_pipeline() -> list[list[str]]:
    """The README's recipe commands, in its order (the bash block that starts with preprocess)."""
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "nopad.recipes.preprocess" in b)
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readmes_commands_in_order_leave_model_path_at_the_newest_runs_newest_checkpoint(
    inputs, tmp_path, monkeypatch
):
    """Each README line in turn, with a tiny model swapped in. Its SFT line and its launch line both
    write runs/sft (the launch line runs here in one process: the directory is what is tested; the
    2-process launch is the slow test below): afterwards model.path=runs/sft must be the launch
    run's newest checkpoint, though the first run's step number is higher."""
    from nopad.recipes.models import check_model_path

    root, _, _ = inputs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")  # the README's relative paths
    tiny = {
        "nopad.recipes.preprocess": [f"tokenizer={root / 'base'}"],
        "nopad.recipes.sft": [f"model.path={root / 'base'}", "train.progress=false", "train.grad_accum=1"],
        "nopad.recipes.evaluate": ["sampling.max_tokens=4", "generator.num_blocks=64"],
        "nopad.recipes.grpo": [
            "reward=tests.recipes.test_recipes_grpo:ids_checksum_reward",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=4",
            "rollout.max_tokens=6",
            "generator.num_blocks=128",
        ],
    }  # tool task: 134 tokens
    commands = readme_pipeline()
    assert [w[:2] for w in commands[:-1]] == [["python", "-m"]] * (len(commands) - 1)
    assert commands[-1][:2] == ["accelerate", "launch"]
    sft_checkpoints = []
    for words in commands:
        at = words.index("-m")
        module, args = words[at + 1], words[at + 2 :]
        # the first SFT run takes more steps than the launch run (the test's value replaces the README's)
        max_steps = (
            ["train.max_steps=1" if words[0] == "accelerate" else "train.max_steps=2"]
            if module == "nopad.recipes.sft"
            else []
        )
        result = importlib.import_module(module).main(with_settings(args, [*tiny[module], *max_steps]))
        _reset_accelerate()
        if module == "nopad.recipes.sft":
            sft_checkpoints.append(Path(result["checkpoint"]))
    first, newest = sft_checkpoints
    assert first == Path("runs/sft/step_2") and newest == Path("runs/sft/step_1")  # the older step is higher
    assert check_model_path("runs/sft") == str(newest)
    steps = [json.loads(x)["step"] for x in Path("runs/sft/metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # the launch run's curve alone; the first run's is kept aside
    assert len(list(Path("runs/sft").glob("metrics.*.jsonl"))) == 1


# ---------------------------------------------------------------------------------- 2 processes
def readme_launch_lines() -> dict[str, list[str]]:
    """The `accelerate launch --config_file ...` lines of the README and docs/, word for word, by
    config file."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in docs).replace("\\\n", " ")  # join continued lines
    lines = re.findall(r"^accelerate launch --config_file \S+ .*$", text, re.M)
    return {shlex.split(line)[3]: shlex.split(line) for line in lines}


def _launch(words: list[str], *overrides: str) -> None:
    """Run a README line (plus a free port, and the test's own settings in place of its)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "DS_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--main_process_port",
        str(launch.free_port()),
        *with_settings(words[2:], overrides),
    ]
    # its own process group: a timeout kills the ranks too, not only the launcher
    returncode, _, err = launch.run_in_group(cmd, 300, cwd=ROOT, env=env)
    if returncode is None:
        pytest.fail(f"`{' '.join(words)}` did not finish in 300 s (a hang?): {err[-2000:]}")
    assert returncode == 0, launch.failure_message(f"`{' '.join(words)}`", err, returncode)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two launches of up to 300 s each
def test_readme_launch_lines_run_ddp_and_deepspeed_zero2(inputs):
    root, _, chats = inputs
    lines = readme_launch_lines()
    assert {"recipes/configs/accelerate_ddp.yaml", "recipes/configs/accelerate_deepspeed.yaml"} <= set(lines)
    expected = _per_document_loss(root / "base", chats)
    runs = {}
    for name, config in [
        ("ddp", "recipes/configs/accelerate_ddp.yaml"),
        ("deepspeed", "recipes/configs/accelerate_deepspeed.yaml"),
    ]:
        out = root / f"sft_{name}"
        _launch(lines[config], *_sft_args(root, out))
        runs[name] = [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)]
    for r in runs["ddp"]:
        assert r["world_size"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU"
    for r in runs["deepspeed"]:  # DeepSpeed really engaged: its engine, ZeRO stage 2
        assert r["world_size"] == 2 and r["distributed_type"] == "DistributedType.DEEPSPEED"
        assert r["deepspeed_engine"] is True and r["zero_stage"] == 2
    for name, results in runs.items():
        assert results[0]["losses"] == results[1]["losses"] and results[0]["steps"] == 3
        assert results[0]["losses"][0] == pytest.approx(expected, rel=1e-4), name
    # same training under both engines (Adam's first steps amplify reduction-order noise: 1e-2)
    assert runs["deepspeed"][0]["losses"] == pytest.approx(runs["ddp"][0]["losses"], rel=1e-2)
    # the ZeRO-2 checkpoint is a consolidated HF model directory that the next stages load: its
    # weights moved from the base as far as DDP's did, and land next to DDP's
    from transformers import AutoModelForCausalLM

    checkpoint = Path(runs["deepspeed"][0]["checkpoint"])
    paths = {"base": root / "base", "ddp": runs["ddp"][0]["checkpoint"], "deepspeed": checkpoint}
    models = {name: AutoModelForCausalLM.from_pretrained(str(path)) for name, path in paths.items()}
    flat = {name: torch.cat([p.flatten() for p in m.parameters()]) for name, m in models.items()}
    moved = (flat["ddp"] - flat["base"]).norm()
    assert moved > 0 and (flat["deepspeed"] - flat["ddp"]).norm() < 0.2 * moved
    _evaluate(checkpoint, root, "eval_deepspeed.jsonl")


def test_console_scripts_point_at_recipe_entry_points():
    """pyproject's console scripts (nopad-sft, ...) name functions that exist and take no
    arguments, and the recipes' configs and sample data ship with the package."""
    import importlib
    import inspect

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    assert {"nopad-preprocess", "nopad-sft", "nopad-grpo", "nopad-evaluate"} <= set(scripts)
    for target in scripts.values():
        module, _, name = target.partition(":")
        fn = getattr(importlib.import_module(module), name)
        assert not inspect.signature(fn).parameters, target
    data = project["tool"]["setuptools"]["package-data"]["nopad.recipes"]
    assert "configs/*.yaml" in data and "data/*.jsonl" in data
