"""GRPO on the live policy: generate with the in-flight generator on the very parameters the
optimizer updates (no copy, no weight sync), score, pack prompt+completion sequences into varlen
rows, recompute the log-probs with the training forward and take one optimizer step.

    python -m recipes.grpo [recipes/configs/grpo.yaml] [key=value ...]
    accelerate launch --config_file recipes/configs/accelerate_zero3.yaml -m recipes.grpo [...]

Under ZeRO-3 / FSDP2 the rollout gathers the full weights once or keeps the ranks in lockstep
(``generator.sharded_rollout``, :mod:`inference.sharded`), every rank trains on the same number of
packed rows and takes exactly one optimizer step per GRPO step (:mod:`training.accumulation`).
Rollouts -> packed rows -> log-probs, the loss and the advantages are :mod:`training.grpo`, the
same code ``NopadGRPOTrainer`` runs.

Generator and trainer run the same attention core, so in fp32 the generator's sampled-token
log-probs equal the training forward's (the gap is reported every step). When they are not equal
(bf16, other kernels), ``train.is_correction`` re-weights each token, e.g. truncated importance
sampling (``tis``: min(pi_train / pi_gen, cap)).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dataloaders.loader import move_batch
from inference.sharded import sharded_generate
from packing.invariance import batch_invariant
from recipes.config import (
    AccelerateConfig,
    ChatModelConfig,
    ConfigError,
    GeneratorConfig,
    Section,
    check_learning_rate,
    load_model,
    parse_cli,
    setup_logging,
)
from recipes.tasks import TASKS, check_prompts_per_step, encode_prompt, get_reward, load_examples
from training import checkpoint
from training.accelerator import engine_info
from training.accelerator import make_accelerator as build_accelerator
from training.accumulation import (
    RowAccumulator,
    global_sum,
    pad_rows,
)
from training.curves import finish_trackers, tracker_config, write_curves
from training.grpo import (
    ISWeightFn,
    Rollout,
    empty_rollout_row,
    group_advantages,
    grpo_token_loss,
    pack_rollouts,
    packed_logprobs,
    resolve_batch_invariant,
    truncated_is,
)

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo.yaml"  # these defaults, with comments
CURVES = ("reward_mean", "loss", "logprob_gap_max")  # plotted to curves.png and sent to the trackers


# ----------------------------------------------------------------------------- config
@dataclass
class TaskConfig(Section):
    """The prompts: a built-in task (``recipes.tasks.TASKS``) or a JSONL file / saved dataset with
    ``prompt`` (and ``answer``) fields."""

    name: str = "arithmetic"  # ignored when prompts is set
    prompts: str | None = None
    prompt_field: str = "prompt"
    num_prompts: int = 64
    seed: int = 0

    def check(self) -> None:
        self.at_least("num_prompts", 1)
        if self.prompts is None and self.name not in TASKS:
            raise ConfigError("name", f"{self.name!r} is not a built-in task; use one of {sorted(TASKS)} "
                              "or set task.prompts to a JSONL file")


@dataclass
class RolloutConfig(Section):
    prompts_per_step: int = 8
    num_generations: int = 8  # completions per prompt (the GRPO group)
    max_prompt_tokens: int = 64  # longer prompts are an error; bounds the KV cache check
    max_tokens: int = 48  # new tokens per completion
    temperature: float = 1.0  # the trained policy is the raw model: keep 1.0 for on-policy
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        for name, low in [("prompts_per_step", 1), ("num_generations", 2), ("max_prompt_tokens", 1),
                          ("max_tokens", 1)]:
            self.at_least(name, low)


@dataclass
class GRPOGeneratorConfig(GeneratorConfig):
    num_blocks: int = 512  # the whole rollout batch must fit
    max_num_batched_tokens: int = 512
    # ZeRO-3 / FSDP2 only: gather (full weights once per rollout) | lockstep (memory-lean)
    sharded_rollout: Literal["gather", "lockstep"] = "gather"


@dataclass
class GRPOTrainConfig(Section):
    steps: int = 2
    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    max_tokens_per_batch: int = 1024  # packing capacity of one training forward
    shared_prefix: bool = True  # each prompt once per row, its completions attending to it
    clip_eps: float = 0.2
    beta: float = 0.0  # KL penalty against a frozen copy of the initial policy
    batch_invariant: bool | Literal["auto"] = "auto"  # see packing.batch_invariant
    is_correction: str | Callable[..., Any] = "none"  # none | tis | "module:function"
    tis_cap: float = 2.0
    seed: int = 0

    def check(self) -> None:
        self.at_least("steps", 0)
        self.at_least("beta", 0.0)
        check_learning_rate(self.lr)
        self.at_least("max_tokens_per_batch", 2)
        if not 0 < self.clip_eps < 1:
            raise ConfigError("clip_eps", f"must be in (0, 1), got {self.clip_eps}")
        resolve_is_correction(self)


@dataclass
class GRPOConfig(Section):
    """The GRPO recipe's settings; ``recipes/configs/grpo.yaml`` lists them with comments."""

    model: ChatModelConfig = field(default_factory=ChatModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: str | Callable[..., Any] = "last_number_match"  # recipes.tasks.REWARDS name or "module:function"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: GRPOGeneratorConfig = field(default_factory=GRPOGeneratorConfig)
    train: GRPOTrainConfig = field(default_factory=GRPOTrainConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)
    output_dir: str | None = None  # metrics.jsonl, curves.png and the trained model (an HF model dir)

    def check(self) -> None:
        get_reward(self.reward, key="reward")
        ro, gen, tr = self.rollout, self.generator, self.train
        seq_tokens = ro.max_prompt_tokens + ro.max_tokens
        num_seqs = ro.prompts_per_step * ro.num_generations
        blocks_needed = num_seqs * math.ceil(seq_tokens / gen.smallest_block_size)
        if blocks_needed > gen.num_blocks:
            raise ValueError(
                f"the rollout batch is larger than the KV cache: rollout.prompts_per_step="
                f"{ro.prompts_per_step} x rollout.num_generations={ro.num_generations} sequences of up to "
                f"{seq_tokens} tokens need {blocks_needed} blocks of {gen.smallest_block_size}, but "
                f"generator.num_blocks={gen.num_blocks}; raise generator.num_blocks or lower "
                "rollout.prompts_per_step / rollout.num_generations / rollout.max_tokens"
            )
        if seq_tokens > tr.max_tokens_per_batch:
            raise ValueError(f"train.max_tokens_per_batch={tr.max_tokens_per_batch} is smaller than one "
                             f"rollout sequence ({seq_tokens} tokens = rollout.max_prompt_tokens + "
                             "rollout.max_tokens); raise it")


def resolve_is_correction(train_cfg: GRPOTrainConfig) -> ISWeightFn | None:
    spec = train_cfg.is_correction
    if spec in (None, "none"):
        return None
    if spec == "tis":
        if train_cfg.tis_cap <= 0:
            raise ConfigError("tis_cap", f"must be > 0, got {train_cfg.tis_cap}")
        return truncated_is(float(train_cfg.tis_cap))
    if callable(spec):
        return spec
    if ":" not in spec and "." not in spec:
        raise ConfigError("is_correction", f"{spec!r} is unknown; use none, tis, or an import path "
                          "'module:function' taking (train_logprobs, gen_logprobs) -> per-token weights")
    return get_reward(spec, key="train.is_correction")  # same import-path resolution


# ----------------------------------------------------------------------------- pieces
def sampling_params(cfg: GRPOConfig, step: int):
    from inference import SamplingParams

    ro = cfg.rollout
    return SamplingParams(n=ro.num_generations, max_tokens=ro.max_tokens, temperature=ro.temperature,
                          top_p=ro.top_p, seed=ro.seed * 1_000_003 + step)


def grpo_step(model, optimizer, generator, batch: list[dict], prompt_ids: list[list[int]], reward_fn,
              tokenizer, cfg: GRPOConfig, step: int = 0, accelerator=None, ref_model=None,
              is_weights: ISWeightFn | None = None, use_tqdm: bool = False, accumulator=None) -> dict:
    """One GRPO step on ``batch`` (examples with their token ids in ``prompt_ids``); returns metrics.
    Every rank calls it each step, also with an empty ``batch``. Pass the same ``accumulator``
    (:class:`training.accumulation.RowAccumulator`) every step to count the optimizer steps."""
    tr = cfg.train
    invariant = resolve_batch_invariant(tr.batch_invariant, next(model.parameters()).device,
                                        "train.batch_invariant")
    # 1. rollouts on the live weights; the KV cache is handed back before any backward pass
    rollouts, rewards_t, rollout_time = _scored_rollouts(model, generator, batch, prompt_ids, reward_fn,
                                                         tokenizer, cfg, step, invariant, use_tqdm)
    completion_tokens = sum(len(r.completion_ids) for r in rollouts)

    # 2. packed training forward + backward over equally many rows on every rank (ZeRO-3 / FSDP2
    # forwards are collectives), loss normalised by all ranks' completion tokens, one optimizer step
    model.train()
    t0 = time.perf_counter()
    rows = pack_rollouts(rollouts, tr.max_tokens_per_batch, shared_prefix=tr.shared_prefix)
    num_loss_tokens = global_sum(sum(r["num_loss_tokens"] for r in rows), accelerator)
    rows = pad_rows(rows, empty_rollout_row, accelerator)
    own_accumulator = accumulator is None
    if own_accumulator:
        accumulator = RowAccumulator(model, optimizer, accelerator)
    accumulator.begin(len(rows))
    gaps, ratios, losses, clipped = [], [], [], 0
    device = next(model.parameters()).device
    for row in rows:
        row = move_batch(row, device)  # as SFT does: CPU rows (and their VarlenMeta) to the model
        with accumulator.row():
            loss, logp, gen_lp, was_clipped = _row_loss(model, row, tr, num_loss_tokens, invariant,
                                                        is_weights, ref_model)
            accumulator.backward(loss)
        if not row.get("empty"):
            gaps.append((logp.detach() - gen_lp).abs())
            ratios.append(torch.exp(logp.detach() - gen_lp))
            losses.append(loss.detach())
            clipped += int(was_clipped.sum())
    grad_norm = accumulator.step(tr.max_grad_norm)
    if own_accumulator:
        accumulator.close()
    rows = [r for r in rows if not r.get("empty")]
    train_time = time.perf_counter() - t0

    gap = torch.cat(gaps) if gaps else torch.zeros(1)
    ratio = torch.cat(ratios) if ratios else torch.ones(1)
    train_tokens = sum(int(r["input_ids"].numel()) for r in rows)
    longest = max((len(r.prompt_ids) + len(r.completion_ids) for r in rollouts), default=0)
    return {
        "step": step,
        "reward_mean": float(rewards_t.mean()),
        "reward_std": float(rewards_t.std()),
        "loss": float(torch.stack(losses).sum()) if losses else 0.0,
        "grad_norm": float(grad_norm),
        "clip_fraction": clipped / max(completion_tokens, 1),  # tokens whose ratio left [1-eps, 1+eps]
        "completion_tokens": completion_tokens,
        "rollout_tokens_per_s": completion_tokens / rollout_time,
        "train_tokens": train_tokens,
        "train_rows": len(rows),
        "padded_train_tokens": longest * len(rollouts),  # what one right-padded batch would compute
        "train_tokens_per_s": train_tokens / train_time,
        "logprob_gap_max": float(gap.max()),
        "logprob_gap_mean": float(gap.mean()),
        # pi_train / pi_rollout of this (first and only) epoch: exactly 1 in batch-invariant mode
        "is_ratio_min": float(ratio.min()),
        "is_ratio_max": float(ratio.max()),
        "batch_invariant": float(invariant),
        "rollout_s": rollout_time,
        "train_s": train_time,
    }


def _scored_rollouts(model, generator, batch, prompt_ids, reward_fn, tokenizer, cfg: GRPOConfig, step: int,
                     invariant: bool, use_tqdm: bool):
    """Generate ``rollout.num_generations`` completions per prompt on the live weights, reward
    them and set each one's group advantage; returns ``(rollouts, rewards (prompts, n), seconds)``."""
    t0 = time.perf_counter()
    with batch_invariant(invariant):
        outputs = sharded_generate(generator, model, prompt_ids, sampling_params(cfg, step),
                                   mode=cfg.generator.sharded_rollout, use_tqdm=use_tqdm)
    rollout_time = time.perf_counter() - t0
    generator.release()
    rollouts, rewards = [], []
    for example, ids, out in zip(batch, prompt_ids, outputs):
        for c in out.outputs:
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            rewards.append(float(reward_fn(text, example)))
            rollouts.append(Rollout(list(ids), list(c.token_ids), [float(x) for x in c.logprobs]))
    rewards_t = torch.tensor(rewards).view(len(batch), cfg.rollout.num_generations)
    if bool((rewards_t.std(dim=1) == 0).all()):
        logger.warning(
            "grpo step %d: every group's rewards are equal (all %s), so every advantage is 0 and this step "
            "does not change the model; give the completions room to answer (rollout.max_tokens), use "
            "larger groups (rollout.num_generations) or a reward that separates them", step,
            sorted(set(rewards_t[:, 0].tolist())))
    for r, a in zip(rollouts, group_advantages(rewards_t).flatten().tolist()):
        r.advantage = a
    return rollouts, rewards_t, rollout_time


def _row_loss(model, row, tr: GRPOTrainConfig, num_loss_tokens: float, invariant: bool, is_weights,
              ref_model):
    """The GRPO loss of one packed row, normalised by all ranks' completion tokens (zero for a
    padding row, which only runs the collectives); also its log-probs and clipped tokens."""
    with batch_invariant(invariant):  # the forward only; any correct backward will do
        logp = packed_logprobs(model, row)
    gen_lp, adv = row["gen_logprobs"].to(logp.device), row["advantages"].to(logp.device)
    if is_weights is None:
        old, weights = gen_lp, None  # ratio against the generator's own log-probs
    else:
        old, weights = logp.detach(), is_weights(logp.detach(), gen_lp).detach()
    ref_lp = None
    if ref_model is not None and tr.beta:
        with torch.no_grad():
            ref_lp = packed_logprobs(ref_model, row)
    tok_loss, was_clipped = grpo_token_loss(logp, old, adv, tr.clip_eps, weights, ref_lp, tr.beta)
    loss = tok_loss.sum() / max(num_loss_tokens, 1.0)
    if row.get("empty"):
        loss = loss * 0.0
    return loss, logp, gen_lp, was_clipped


# ----------------------------------------------------------------------------- the run
def build_prompts(cfg: GRPOConfig, tokenizer) -> tuple[list[dict], list[list[int]]]:
    """The task's examples and their prompt token ids (chat template when configured)."""
    task = cfg.task
    if task.prompts is not None:
        examples = load_examples(task.prompts, task.prompt_field, key="task.prompts")
    else:
        examples = TASKS[task.name](num_prompts=task.num_prompts, seed=task.seed)
    limit = cfg.rollout.max_prompt_tokens
    ids = []
    for i, ex in enumerate(examples):
        tokens = encode_prompt(tokenizer, str(ex[task.prompt_field]), chat=cfg.model.chat_template)
        if not tokens or len(tokens) > limit:
            raise ValueError(f"prompt {i} has {len(tokens)} tokens; rollout.max_prompt_tokens={limit} "
                             "(raise it, or shorten the prompt)")
        ids.append(tokens)
    return examples, ids


def save_model_dir(accelerator, model, tokenizer, path: Path) -> None:
    """The trained policy as an HF model directory (config, weights, tokenizer)."""
    from recipes.config import save_model_dir as save

    save(accelerator, model, tokenizer, path)
    logger.info("saved the policy to %s (load it with model.path=%s)", path, path)


def make_generator(model, cfg: GRPOConfig):
    from inference import Generator

    g = cfg.generator
    return Generator(model, block_size=g.block_size, num_blocks=g.num_blocks,
                     max_num_seqs=g.max_num_seqs, max_num_batched_tokens=g.max_num_batched_tokens)


def make_accelerator(cfg: GRPOConfig):
    """The run's Accelerator (:func:`training.accelerator.make_accelerator`); GRPO steps the
    optimizer once per step over all packed rows (:class:`training.accumulation.RowAccumulator`)."""
    return build_accelerator(cfg.accelerate.deepspeed_config,
                             max_grad_norm=cfg.train.max_grad_norm, recipe="recipes.grpo",
                             log_with=cfg.accelerate.log_with, project_dir=cfg.output_dir)


def run_grpo(cfg: GRPOConfig, model=None, tokenizer=None, progress: bool = True) -> list[dict]:
    """Train for ``train.steps`` GRPO steps; returns (and logs) one metrics dict per step.
    Pass ``model``/``tokenizer`` to train objects you already hold (then ``model.path`` is unused)."""
    from tqdm.auto import tqdm

    from packing.hf import NOPAD_ATTENTION, register_nopad_attention, use_nopad_attention

    if model is None:
        model, tokenizer = load_model(cfg.model)
    elif tokenizer is None:
        raise ValueError("pass the tokenizer together with the model")
    reward_fn = get_reward(cfg.reward)
    is_weights = resolve_is_correction(cfg.train)
    examples, prompt_ids = build_prompts(cfg, tokenizer)
    tr, ro = cfg.train, cfg.rollout

    ref_model = None
    if tr.beta:  # frozen initial policy for the KL term, also on packed rows
        register_nopad_attention()
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        ref_model.set_attn_implementation(NOPAD_ATTENTION)
    accelerator = make_accelerator(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=tr.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    logger.info("training with %s on %d process(es)", engine_info(model, accelerator),
                accelerator.num_processes)
    accumulator = RowAccumulator(model, optimizer, accelerator)
    accelerator.init_trackers("nopad-grpo", config=tracker_config(cfg.to_dict()))
    policy = accelerator.unwrap_model(model)  # the same parameters: the generator reads them live
    generator = make_generator(policy, cfg)

    torch.manual_seed(tr.seed)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(tr.seed)).tolist()
    rank, world = accelerator.process_index, accelerator.num_processes
    per_step = ro.prompts_per_step
    check_prompts_per_step(len(examples), per_step, world)
    out_file = None
    if cfg.output_dir:  # lock: two runs at once into one directory stop with the other's pid
        checkpoint.claim_run_dir(cfg.output_dir, accelerator)
    if cfg.output_dir and accelerator.is_main_process:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        out_file = open(Path(cfg.output_dir) / "metrics.jsonl", "w")
    history = []
    bar = tqdm(range(tr.steps), desc="grpo", disable=not progress or not accelerator.is_main_process)
    with use_nopad_attention(policy):  # packed training rows; the generator switches to paged itself
        for step in bar:
            start = (step * world + rank) * per_step
            picks = [order[(start + j) % len(order)] for j in range(per_step)]
            metrics = grpo_step(model, optimizer, generator, [examples[i] for i in picks],
                                [prompt_ids[i] for i in picks], reward_fn, tokenizer, cfg, step=step,
                                accelerator=accelerator, ref_model=ref_model, is_weights=is_weights,
                                use_tqdm=progress, accumulator=accumulator)
            history.append(metrics)
            logger.info("grpo step %d: %s", step, json.dumps({k: round(v, 6) for k, v in metrics.items()}))
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", gap=f"{metrics['logprob_gap_max']:.1e}")
            accelerator.log({k: metrics[k] for k in CURVES}, step=step)  # to the log_with trackers
            if out_file is not None:
                out_file.write(json.dumps(metrics) + "\n")
                out_file.flush()
    if out_file is not None:
        out_file.close()
        write_curves(Path(cfg.output_dir) / "metrics.jsonl", CURVES, "nopad GRPO")
    finish_trackers(accelerator)
    generator.release()
    if cfg.output_dir:  # an HF model directory: model.path=<output_dir> in evaluate / grpo / SFT
        save_model_dir(accelerator, model, tokenizer, Path(cfg.output_dir))
    return history


def main(argv: list[str] | None = None) -> list[dict]:
    setup_logging("%(message)s")
    return run_grpo(parse_cli(GRPOConfig, argv, "recipes.grpo", __doc__))


def cli() -> None:
    """The ``nopad-grpo`` console script: the recipe from any directory once nopad is installed."""
    main()


if __name__ == "__main__":
    main()
