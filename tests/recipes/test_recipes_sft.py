"""recipes/sft.py: in-process exact resume (fast); 2-process DDP and DeepSpeed ZeRO-2 runs on CPU
(slow): every sequence once per epoch, equal steps, first loss == unpacked single-process loss."""

import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nopad.recipes.config import load_config
from nopad.recipes.sft import DEFAULT_CONFIG, train
from nopad.recipes.sft_config import SFTDataConfig, SFTModelConfig, SFTRecipeConfig
from nopad.recipes.tiny_model import tiny_causal_lm
from nopad.training.sft_data import synthetic_rows, tokenize_rows
from tests.support import launch

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "model.path=tiny:llama",
    "data.num_rows=24",
    "data.min_len=4",
    "data.max_len=40",
    "data.tokens_per_batch=96",
    "train.lr=1.0e-3",
    "train.progress=false",
]


def _cfg(tmp_path, *extra):
    return load_config(SFTRecipeConfig, None, SMALL + [f"checkpoint.output_dir={tmp_path}", *extra])


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _params(tmp_path, step):
    from safetensors.torch import load_file

    return load_file(str(tmp_path / f"step_{step}" / "model.safetensors"))


def test_stop_and_resume_gives_the_uninterrupted_run(tmp_path):
    full = train(_cfg(tmp_path / "full", "train.epochs=2"))
    per_epoch = full["steps"] // 2
    assert full["steps"] == 2 * per_epoch and per_epoch >= 2
    _reset_accelerate()
    stop = per_epoch + 1  # mid second epoch
    first = train(_cfg(tmp_path / "cut", "train.epochs=2", f"train.max_steps={stop}"))
    _reset_accelerate()
    rest = train(_cfg(tmp_path / "cut", "train.epochs=2", "checkpoint.resume_from=latest"))
    _reset_accelerate()
    assert first["losses"] + rest["losses"] == full["losses"]
    a, b = _params(tmp_path / "full", full["steps"]), _params(tmp_path / "cut", rest["steps"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full["stats"][0]["sequences_dropped"] == 0 and full["stats"][0]["tokens"] > 0


def test_gradient_checkpointing_trains_the_same_model(tmp_path):
    """train.gradient_checkpointing (activations, not weights, fill a CPU's memory)
    recomputes each layer in backward through the packed-row path: same losses and weights."""
    plain = train(_cfg(tmp_path / "plain", "train.max_steps=2"))
    _reset_accelerate()
    ckpt = train(_cfg(tmp_path / "ckpt", "train.max_steps=2", "train.gradient_checkpointing=true"))
    _reset_accelerate()
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-7)
    a, b = _params(tmp_path / "plain", 2), _params(tmp_path / "ckpt", 2)
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_streaming_loader_resumes_exactly_from_a_mid_run_checkpoint(tmp_path):
    stream = ("data.streaming=true", "data.buffer_size=8", "train.max_steps=7", "train.epochs=5")
    full = train(_cfg(tmp_path / "full", *stream, "checkpoint.every=4"))
    _reset_accelerate()
    rest = train(_cfg(tmp_path / "rest", *stream, f"checkpoint.resume_from={tmp_path / 'full' / 'step_4'}"))
    _reset_accelerate()
    # 3 optimizer steps per stream epoch: the checkpoint is mid epoch 1, the run ends in epoch 2
    assert full["stats"][0]["steps_per_rank"] == 6 and len(full["stats"]) == 2
    assert full["steps"] == rest["steps"] == 7 and rest["losses"] == full["losses"][4:]
    assert full["stats"][0]["sequences_dropped"] == 0
    with pytest.raises(ValueError, match="needs train.max_steps"):
        train(_cfg(tmp_path / "bad", "data.streaming=true"))
    _reset_accelerate()


def test_text_rows_mask_the_prompt():
    class Tok:
        eos_token_id = 2

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    rows = [{"prompt": "ab", "completion": "c"}, {"input_ids": [5]}]
    rows = tokenize_rows(rows, Tok(), "prompt", "completion")
    assert rows == [{"input_ids": [97, 98, 99, 2], "labels": [-100, -100, 99, 2]}, {"input_ids": [5]}]
    with pytest.raises(KeyError, match="'prompt' and 'completion'"):
        tokenize_rows([{"text": "x"}], Tok(), "prompt", "completion")


def test_bad_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="train.batch_size is not a config key here; known keys: epochs"):
        load_config(SFTRecipeConfig, None, ["train.batch_size=3"])
    assert load_config(SFTRecipeConfig, DEFAULT_CONFIG) == SFTRecipeConfig()  # the shipped YAML: defaults
    with pytest.raises(ValueError, match="train.weighting"):
        train(_cfg(tmp_path, "train.weighting=mean"))
    with pytest.raises(FileNotFoundError, match="data.source"):
        train(_cfg(tmp_path, "data.source=/nonexistent"))
    _reset_accelerate()


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.max_steps=abc", "train.max_steps must be an integer or null, got 'abc'"),
        ("train.max_steps=0", "train.max_steps must be an integer >= 1 or null, got 0"),
        ("train.epochs=0", "train.epochs must be an integer >= 1, got 0"),
        ("train.grad_accum=1.5", "train.grad_accum must be an integer, got 1.5"),
        ("data.tokens_per_batch=big", "data.tokens_per_batch must be an integer or null, got 'big'"),
        ("data.overflow=drop", "data.overflow must be 'error', 'truncate' or 'split', got 'drop'"),
        ("data.max_dropped_fraction=2", "data.max_dropped_fraction must be a number in [0, 1], got 2.0"),
    ],
)
def test_settings_that_would_train_nothing_or_crash_later_fail_first(tmp_path, override, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        train(_cfg(tmp_path, override))


@pytest.mark.parametrize(
    "rows, override, match",
    [
        (
            [{"input_ids": [3, 4, 500, 6]}],
            None,
            r"row 0 holds token id 500, outside the model's vocabulary \(ids 0..127\); the rows were tokenized",
        ),
        ([{"input_ids": [3, 4]}, {"input_ids": [5, -1]}], None, r"row 1 holds token id -1, outside"),
        (
            [{"input_ids": [3, 4, 5], "labels": [-100, -100, -100]}],
            None,
            r"every label is -100, so no token has a loss and nothing would be trained",
        ),
        (
            [{"input_ids": [3, 4, 5]}],
            "model.attn_implementation=flash",
            r"^model.attn_implementation 'flash' cannot be used: .*model.attn_implementation=nopad\)$",
        ),
    ],
)
def test_rows_the_model_cannot_train_on_fail_before_the_first_step(tmp_path, rows, override, match):
    """Ids from another tokenizer used to fail inside the first forward (IndexError: index out of
    range in self), all-masked labels trained at loss 0.0 without a word, and a wrong attention name
    was transformers' traceback."""
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=match):
        train(_cfg(tmp_path / "run", f"data.source={source}", *([override] if override else [])))
    _reset_accelerate()


def test_max_steps_counts_optimizer_steps_and_repeats_epochs(tmp_path, caplog):
    one = train(_cfg(tmp_path / "one"))
    _reset_accelerate()
    want = one["steps"] * 2 + 1  # more than one epoch holds
    with caplog.at_level(logging.WARNING, logger="nopad.training.sft_data"):
        more = train(_cfg(tmp_path / "more", f"train.max_steps={want}"))
    _reset_accelerate()
    assert more["steps"] == len(more["losses"]) == want and len(more["stats"]) == 3
    assert any("the data repeats for 3 epochs" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="nopad.recipes.sft"):  # resuming a finished run says so
        again = train(_cfg(tmp_path / "more", f"train.max_steps={want}", "checkpoint.resume_from=latest"))
    _reset_accelerate()
    assert again["losses"] == [] and any("nothing to train" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.grad_accum=4", "train.grad_accum=2 but this run has train.grad_accum=4"),
        ("data.tokens_per_batch=128", "tokens_per_batch=96 but this loader has tokens_per_batch=128"),
        ("data.max_seqs_per_batch=2", "max_seqs_per_batch=None but this loader has max_seqs_per_batch=2"),
        ("data.num_rows=25", "num_sequences=24 but this loader has num_sequences=25"),
        ("data.seed=3", "lengths_digest="),
        # the checkpoint's optimizer state used to keep silently the old learning rate
        ("train.lr=1e-4", "train.lr=0.001 but this run has train.lr=0.0001"),
    ],
)
def test_resume_under_another_plan_is_refused_naming_the_field(tmp_path, override, field):
    train(_cfg(tmp_path, "train.max_steps=1"))
    _reset_accelerate()
    with pytest.raises(ValueError, match=re.escape(field)):
        train(_cfg(tmp_path, override, "checkpoint.resume_from=latest"))
    _reset_accelerate()


def test_checkpoint_is_an_hf_model_dir_with_the_tiny_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM

    from nopad.recipes.models import load_model
    from nopad.recipes.tiny_model import AsciiTokenizer

    result = train(_cfg(tmp_path, "train.max_steps=1"))
    _reset_accelerate()
    step = Path(result["checkpoint"])
    assert step == tmp_path / "step_1" and result["deepspeed_engine"] is False
    model = AutoModelForCausalLM.from_pretrained(str(step))
    saved = _params(tmp_path, 1)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)
    _, tok = load_model(SFTModelConfig(path=str(step)))
    assert isinstance(tok, AsciiTokenizer) and tok("hi")["input_ids"] == [104, 105]


def test_a_deepspeed_config_under_accelerate_use_cpu_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    ds = ROOT / "recipes/configs/deepspeed_zero2.json"
    with pytest.raises(ValueError, match="ACCELERATE_USE_CPU=1 makes Accelerate drop DeepSpeed"):
        train(_cfg(tmp_path, f"accelerate.deepspeed_config={ds}"))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` sets
    with pytest.raises(ValueError, match="ACCELERATE_USE_CPU=1 makes Accelerate drop DeepSpeed"):
        train(_cfg(tmp_path))


# ---------------------------------------------------------------------------------- 2 processes
def _torchrun(*runs: tuple, deepspeed=False) -> list[list[dict]]:
    """Each ``(out_dir, *overrides)`` of ``runs`` as a 2-process SFT run, all in one launch
    (tests.support.recipe_runs: one start-up); each run's per-rank results."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    extra = ()
    if deepspeed:  # DeepSpeed on CPU: DS_ACCELERATOR=cpu and NOT ACCELERATE_USE_CPU (which drops it)
        del env["ACCELERATE_USE_CPU"]
        env["DS_ACCELERATOR"] = "cpu"
        extra = (f"accelerate.deepspeed_config={ROOT / 'recipes/configs/deepspeed_zero2.json'}",)
    args = []
    for out_dir, *overrides in runs:
        given = any(o.startswith("log.record_indices=") for o in overrides)  # a key is given once
        indices = () if given else ("log.record_indices=true",)
        args += [
            *(["--"] if args else []),
            "sft",
            *SMALL,
            f"checkpoint.output_dir={out_dir}",
            *indices,
            *overrides,
            *extra,
        ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(launch.free_port()),
        "-m",
        "tests.support.recipe_runs",
        *args,
    ]
    launch.run(cmd, what="nopad.recipes.sft on 2 processes", timeout=300 * len(runs), env=env, cwd=ROOT)
    return [
        [json.loads((Path(out_dir) / f"result_rank{r}.json").read_text()) for r in range(2)] for out_dir, *_ in runs
    ]


def _unpacked_mean_loss():
    """Mean loss over every loss token of the synthetic data at the initial weights, one
    sequence at a time in one process: what the first optimizer step must report."""
    data = load_config(SFTRecipeConfig, None, SMALL).data
    model, _ = tiny_causal_lm()
    rows = synthetic_rows(data.num_rows, data.min_len, data.max_len, model.config.vocab_size, data.seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor(row["input_ids"])[None], use_cache=False).logits[0, :-1]
            target = torch.tensor(row["labels"])[1:]
            total += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
    return total / count, len(rows)


# grad_accum large enough that each epoch is ONE optimizer step: the first step's loss is the mean
# over all sequences, which must equal the unpacked single-process mean at the initial weights
ONE_STEP_PER_EPOCH = ("train.grad_accum=4", "train.epochs=2")


def _check_two_rank_run(results):
    expected_loss, num_rows = _unpacked_mean_loss()
    assert results[0]["micro_batches_per_epoch"] == results[1]["micro_batches_per_epoch"]
    assert results[0]["steps"] == results[1]["steps"] == 2
    for epoch in range(2):  # every sequence exactly once per epoch over both ranks: not sharded twice
        k = results[0]["micro_batches_per_epoch"]
        batches = [b for r in results for b in r["indices_per_step"][epoch * k : (epoch + 1) * k]]
        seen = [i for batch in batches for i in batch]
        assert sorted(seen) == list(range(num_rows))
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["losses"][0] == pytest.approx(expected_loss, rel=1e-5)


TWO_EPOCHS = ("train.grad_accum=2", "train.epochs=2", "log.record_indices=false")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One launch: the one-step-per-epoch run, and a two-epoch run that checkpoints at step 3."""
    out = tmp_path_factory.mktemp("ddp")
    one, two = _torchrun((out / "one", *ONE_STEP_PER_EPOCH), (out / "two", *TWO_EPOCHS, "checkpoint.every=3"))
    return one, two, out / "two"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the fixture's launch (600 s) and the resume's (300 s)
def test_ddp_two_processes_loss_matches_unpacked_and_resumes_exactly(tmp_path, ddp_runs):
    one, two, two_dir = ddp_runs
    _check_two_rank_run(one)
    # the uninterrupted run leaves its mid-epoch step_3 checkpoint behind: resuming from it (one
    # launch less than a run cut at step 3), in a fresh launch, must give the rest of that run
    assert two[0]["steps"] >= 4 and (two_dir / "step_3").is_dir()
    [rest] = _torchrun((tmp_path / "rest", *TWO_EPOCHS, f"checkpoint.resume_from={two_dir / 'step_3'}"))
    assert two[0]["losses"][:3] + rest[0]["losses"] == two[0]["losses"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # one launch of up to 300 s
def test_deepspeed_zero2_two_processes_matches_unpacked_and_ddp(tmp_path, ddp_runs):
    [results] = _torchrun((tmp_path / "ds", *ONE_STEP_PER_EPOCH), deepspeed=True)
    assert all(r["deepspeed_engine"] and r["zero_stage"] == 2 for r in results)  # not a silent DDP
    _check_two_rank_run(results)
    # the second step's loss depends on the first step's gradient: DeepSpeed's own loss scaling by
    # 1/grad_accum and rank averaging are undone exactly as under DDP
    assert results[0]["losses"] == pytest.approx(ddp_runs[0][0]["losses"], rel=1e-5)


def _data_cfg(**overrides) -> SFTDataConfig:
    return SFTDataConfig(**{"source": "packed_chat", **overrides})


def test_prepacked_rows_train_with_the_default_budget_and_too_small_a_budget_names_the_keys():
    from nopad.training.sft_data import plan_budget

    rows = [{"input_ids": list(range(n)), "seq_lengths": [n - 3, 3]} for n in (2042, 900, 1500)]
    assert plan_budget(_data_cfg(), rows) == 2042  # a pre-packed row is already a bin
    with pytest.raises(
        ValueError,
        match=r"data.tokens_per_batch=1024 is smaller than 2 of the pre-packed "
        r"rows.*leave data.tokens_per_batch unset",
    ):
        plan_budget(_data_cfg(tokens_per_batch=1024), rows)
    plain = [{"input_ids": list(range(n))} for n in (10, 2000)]
    assert plan_budget(_data_cfg(overflow="split"), plain) == 1024
    with pytest.raises(ValueError, match=r"data.tokens_per_batch >= 2000, or data.overflow=split"):
        plan_budget(_data_cfg(), plain)


def test_truncation_that_drops_a_large_share_is_refused_unless_accepted(caplog):
    from nopad.training.sft_data import plan_budget

    rows = [{"input_ids": list(range(n)), "seq_lengths": [n]} for n in (2042, 2000, 500)]
    dropped = r"would drop 1,994 of 4,542 tokens \(44%\).*max_dropped_fraction=0.44"
    with pytest.raises(ValueError, match=dropped):
        plan_budget(_data_cfg(tokens_per_batch=1024, overflow="truncate"), rows)
    with caplog.at_level(logging.WARNING):
        assert (
            plan_budget(_data_cfg(tokens_per_batch=1024, overflow="truncate", max_dropped_fraction=0.5), rows) == 1024
        )
    assert "drops 1994 tokens" in caplog.text


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lr=abc", "train.lr must be a number, got 'abc'"),
        ("train.progress=maybe", "train.progress must be true or false, got 'maybe'"),
        ("model.dtype=int8", "model.dtype must be 'float32', 'bfloat16' or 'float16', got 'int8'"),
        ("model=smollm2", "model is a section; set its fields as model.<field>=..."),
    ],
)
def test_a_wrong_type_is_an_error_naming_the_key(tmp_path, override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train(_cfg(tmp_path, override))


def test_the_progress_bar_counts_micro_batches(tmp_path, monkeypatch):
    """The bar used to move once per optimizer step, which on a small machine is minutes."""
    from tests.support.progress_recorder import record_bars

    bars = record_bars(monkeypatch)
    train(
        _cfg(tmp_path, "train.progress=true", "train.max_steps=2", "train.grad_accum=3", "checkpoint.save_final=false")
    )
    _reset_accelerate()
    sft_bars = [bar for bar in bars if bar.unit == "micro-batch"]
    assert len(sft_bars) == 1 and sft_bars[0].total == 2 * 3
    assert sft_bars[0].updates == [1] * 6
