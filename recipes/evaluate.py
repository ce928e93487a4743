"""Batched evaluation with the in-flight generator: accuracy under a scorer, tokens/s, and one
JSONL line per prompt (prompt, completion, score, ...).

    python -m nopad.recipes.evaluate [recipes/configs/evaluate.yaml] [key=value ...]
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nopad.recipes.cli import run_recipe
from nopad.recipes.config import (
    ChatModelConfig,
    ConfigError,
    GeneratorConfig,
    Section,
    check_sampling,
    parse_cli,
    setup_logging,
)
from nopad.recipes.models import load_model
from nopad.recipes.reward_calls import with_timeout
from nopad.recipes.tasks import TASKS, example_fields, get_reward, load_examples

if TYPE_CHECKING:
    from nopad.training.grpo_step import RewardFn

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "evaluate.yaml"  # these defaults, with comments
DEFAULT_TASK_PROMPTS = 32  # data.num_prompts=null on a built-in task


@dataclass
class EvalDataConfig(Section):
    """The prompts: ``path`` (a JSONL file or a ``save_to_disk`` directory) or a built-in ``task``."""

    path: str | None = None  # prompts: JSONL(.gz), JSON, parquet, CSV or a saved dataset; null: task
    task: str = "arithmetic"  # the built-in task used when path is null
    num_prompts: int | None = None  # the first N prompts; null: all of data.path, 32 of a task
    seed: int = 1  # the built-in task's sampling of prompts
    prompt_field: str = "prompt"  # the field of each record that holds the prompt

    def check(self) -> None:
        self.at_least("num_prompts", 1)
        if self.path is None and self.task not in TASKS:
            raise ConfigError(
                "task", f"{self.task!r} is not a built-in task; use one of {sorted(TASKS)} or set data.path"
            )
        if self.path is not None and not Path(self.path).exists():
            raise ConfigError(
                "path",
                f"{self.path!r} does not exist; give a JSONL file or a directory written by datasets' save_to_disk",
            )


@dataclass
class EvalSamplingConfig(Section):
    max_tokens: int = 32  # new tokens per completion
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0  # sampling seed (used when temperature > 0)

    def check(self) -> None:
        check_sampling(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed)


@dataclass
class EvaluateConfig(Section):
    """The evaluate recipe's settings; ``recipes/configs/evaluate.yaml`` lists them with comments."""

    model: ChatModelConfig = field(default_factory=ChatModelConfig)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    scorer: str | Callable[..., Any] = "last_number_match"  # nopad.recipes.tasks.REWARDS name or "module:function"
    scorer_timeout: float | None = 60.0  # seconds a scorer call may take, else the run stops; null: no limit
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    batch_size: int = 64  # prompts handed to the generator at once
    output: str | None = "runs/evaluate/eval_results.jsonl"  # one JSON line per prompt; null: none

    def check(self) -> None:
        self.at_least("batch_size", 1)
        get_reward(self.scorer, key="scorer")
        if self.scorer_timeout is not None and not self.scorer_timeout > 0:
            raise ConfigError("scorer_timeout", f"must be > 0 seconds or null (no limit), got {self.scorer_timeout}")


def evaluate(
    generator,
    tokenizer,
    examples: Sequence[Mapping],
    scorer: RewardFn,
    sampling_params,
    *,
    output_path: str | Path | None = None,
    prompt_field: str = "prompt",
    chat: bool | str = "auto",
    batch_size: int = 64,
    progress: bool = True,
) -> dict:
    """Generate one completion per example in batches of ``batch_size`` and score it.

    Returns ``accuracy`` (mean score), ``num_prompts``, ``prompt_tokens``, ``completion_tokens``,
    ``seconds`` (generation only) and ``tokens_per_s`` (completion tokens per generation second).
    With ``output_path`` each example becomes one JSONL line, in input order.
    """
    from tqdm.auto import tqdm

    from nopad.inference.chat import encode_prompt
    from nopad.training.nonfinite import describe_sample, reward_value

    if getattr(sampling_params, "n", 1) != 1:
        raise ValueError(f"evaluation scores one completion per prompt; got sampling n={sampling_params.n}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not examples:
        raise ValueError("nothing to evaluate: the prompt set is empty")
    prompt_ids = [encode_prompt(tokenizer, str(ex[prompt_field]), chat=chat) for ex in examples]
    out_file = None
    if output_path is not None:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
        out_file = open(output_path, "w")
    scores, prompt_tokens, completion_tokens, seconds = [], 0, 0, 0.0
    try:
        with tqdm(total=len(examples), desc="evaluate", unit="prompt", disable=not progress) as bar:
            for lo in range(0, len(examples), batch_size):
                batch_ids = prompt_ids[lo : lo + batch_size]
                t0 = time.perf_counter()
                outputs = generator.generate(
                    batch_ids, sampling_params, use_tqdm=False, on_output=lambda _: bar.update(1)
                )  # per finished sequence
                seconds += time.perf_counter() - t0
                for i, out in enumerate(outputs, start=lo):
                    sample = out.outputs[0]
                    text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
                    about = describe_sample(examples[i], prompt_field)
                    where = f"prompt {i}{about}, completion {text[:60]!r}"
                    score = reward_value(scorer(text, examples[i]), scorer, where, kind="scorer")
                    scores.append(score)
                    prompt_tokens += len(prompt_ids[i])
                    completion_tokens += len(sample.token_ids)
                    if out_file is not None:
                        line = {
                            "index": i,
                            "prompt": examples[i][prompt_field],
                            "completion": text,
                            "score": score,
                            "finish_reason": sample.finish_reason,
                            "num_prompt_tokens": len(prompt_ids[i]),
                            "num_completion_tokens": len(sample.token_ids),
                        }
                        if "answer" in examples[i]:
                            line["answer"] = examples[i]["answer"]
                        out_file.write(json.dumps(line) + "\n")
                bar.set_postfix(acc=f"{sum(scores) / len(scores):.3f}")
    finally:
        if out_file is not None:
            out_file.close()
    return {
        "accuracy": sum(scores) / len(scores),
        "num_prompts": len(scores),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "seconds": seconds,
        "tokens_per_s": completion_tokens / seconds if seconds > 0 else float("nan"),
    }


def run_evaluate(cfg: EvaluateConfig, model=None, tokenizer=None, progress: bool = True) -> dict:
    """Evaluate the configured model (or the given ``model``/``tokenizer``) on the prompt set."""
    from nopad.inference import Generator, SamplingParams

    scorer = with_timeout(
        get_reward(cfg.scorer, key="scorer"), cfg.scorer_timeout, "scorer_timeout", cfg.data.prompt_field, kind="scorer"
    )
    data = cfg.data
    if data.path is not None:
        reader = f"scorer={cfg.scorer}" if isinstance(cfg.scorer, str) else "the scorer"
        examples = load_examples(data.path, data.prompt_field, needs=example_fields(scorer), reader=reader)
        if data.num_prompts is not None:
            if data.num_prompts > len(examples):
                logger.warning(
                    "data.num_prompts=%d but %s holds %d prompts: evaluating all %d",
                    data.num_prompts,
                    data.path,
                    len(examples),
                    len(examples),
                )
            examples = examples[: data.num_prompts]
    else:
        examples = TASKS[data.task].examples(num_prompts=data.num_prompts or DEFAULT_TASK_PROMPTS, seed=data.seed)
    if model is None:  # after the prompts: a prompt set the scorer cannot score fails before the load
        model, tokenizer = load_model(cfg.model)
    s, g = cfg.sampling, cfg.generator
    params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed)
    generator = Generator(
        model,
        block_size=g.block_size,
        num_blocks=g.num_blocks,
        max_num_seqs=g.max_num_seqs,
        max_num_batched_tokens=g.max_num_batched_tokens,
    )
    try:
        result = evaluate(
            generator,
            tokenizer,
            examples,
            scorer,
            params,
            output_path=cfg.output,
            prompt_field=data.prompt_field,
            chat=cfg.model.chat_template,
            batch_size=cfg.batch_size,
            progress=progress,
        )
    finally:
        generator.release()
    logger.info(
        "accuracy %.4f on %d prompts, %.1f completion tokens/s%s",
        result["accuracy"],
        result["num_prompts"],
        result["tokens_per_s"],
        f", results in {cfg.output}" if cfg.output else "",
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_cli(EvaluateConfig, argv, "nopad.recipes.evaluate", __doc__)  # --help: before torch loads
    setup_logging("%(message)s")
    return run_evaluate(cfg)


def cli() -> None:
    """The ``nopad-evaluate`` console script: the recipe from any directory once nopad is installed."""
    run_recipe(main, "nopad.recipes.evaluate")


if __name__ == "__main__":
    cli()
