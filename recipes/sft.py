"""Supervised fine-tuning of a Hugging Face causal LM on nopad's packed batches, under Accelerate
(DDP, or DeepSpeed ZeRO-2 with ``accelerate.deepspeed_config``).

Read top to bottom: build the model and the rows, a packed loader that shards itself over the
ranks (it is NOT passed to ``accelerator.prepare``, which would shard it a second time), then one
optimizer step per window of ``grad_accum`` micro-batches with the loss normalised by the window's
global loss-token count (:mod:`nopad.training.sft`, :mod:`nopad.training.sft_data`). Checkpoints hold model,
optimizer, scheduler, RNG and loader position, so ``checkpoint.resume_from`` continues with
exactly the batches the uninterrupted run would see.

    python -m nopad.recipes.sft recipes/configs/sft.yaml train.epochs=1 model.path=tiny:llama
    accelerate launch --config_file recipes/configs/accelerate_ddp.yaml -m nopad.recipes.sft
    accelerate launch --config_file recipes/configs/accelerate_deepspeed.yaml -m nopad.recipes.sft

Each checkpoint ``step_N`` is a Hugging Face model directory (``model.path=.../step_N`` in
evaluate, GRPO or ``from_pretrained``) with the resume state in ``step_N/training_state``. With
``model.lora`` set (LoRA through peft) it is an adapter directory instead: the adapter alone, its
base model recorded in ``adapter_config.json``, and ``model.path`` loads it onto that base.

``train(SFTRecipeConfig(train={"max_steps": 3}), model=..., tokenizer=..., rows=...)`` runs the
same loop in-process (the demo uses it). DeepSpeed's fixed micro-batch size is one packed row
(``train_micro_batch_size_per_gpu: 1``); the token budget is ``data.tokens_per_batch``.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from nopad.recipes.cli import raised_on_purpose, run_recipe
from nopad.recipes.config import ConfigError, parse_cli, setup_logging
from nopad.recipes.models import check_resume_lora, load_model, save_model_dir
from nopad.recipes.sft_config import SFTRecipeConfig

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "sft.yaml"  # these defaults, with comments


# ---------------------------------------------------------------------------------- the run
def make_accelerator(cfg: SFTRecipeConfig):
    """The run's Accelerator (:func:`nopad.training.accelerator.make_accelerator`) from the config."""
    from nopad.training.accelerator import make_accelerator as build_accelerator

    return build_accelerator(
        cfg.accelerate.deepspeed_config,
        grad_accum=cfg.train.grad_accum,
        max_grad_norm=cfg.train.max_grad_norm,
        recipe="nopad.recipes.sft",
        log_with=cfg.accelerate.log_with,
        project_dir=cfg.checkpoint.output_dir,
    )


def model_to_train(cfg: SFTRecipeConfig, model=None, tokenizer=None):
    """``(model, tokenizer)``: ``model.path`` loaded unless given, set up to train (nopad attention,
    no KV cache, activation checkpointing when asked); a resumed run's changed LoRA setting is
    named before the model loads."""
    from nopad.training import checkpoint
    from nopad.training import sft as sft_loop

    ccfg = cfg.checkpoint
    if ccfg.resume_from:
        check_resume_lora(checkpoint.resume_path(ccfg.resume_from, Path(ccfg.output_dir)), cfg.model.lora)
    if model is None:  # tiny:llama comes with the ASCII tokenizer, so its checkpoints reload too
        model, tokenizer = load_model(cfg.model)
    try:
        sft_loop.use_attention(model, cfg.model.attn_implementation)
    except (ValueError, ImportError) as err:  # transformers': an unknown name, flash-attn not installed
        if raised_on_purpose(err):  # nopad's own (a layer it cannot pack): already says what to do
            raise
        raise ConfigError(
            "model.attn_implementation",
            f"{cfg.model.attn_implementation!r} cannot be used: "
            f"{err} (nopad's packed attention: model.attn_implementation=nopad)",
        ) from None
    model.config.use_cache = False
    if cfg.train.gradient_checkpointing:  # non-reentrant: row kwargs pass, ZeRO-3 re-gathers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, tokenizer


def training_rows(dcfg, rows, tokenizer, vocab_size: int):
    """The rows to pack: ``data.source``'s unless ``rows`` are given (then tokenized, or made
    per-turn samples of their conversations with ``data.per_turn_samples``)."""
    from nopad.training import sft_data

    if rows is None:
        return sft_data.load_rows(dcfg, tokenizer, vocab_size)
    if dcfg.per_turn_samples:  # conversations: each assistant turn a sample, packed as trees
        return sft_data.per_turn_samples(rows, tokenizer, dcfg.messages_column)
    return sft_data.tokenize_rows(rows, tokenizer, dcfg.prompt_column, dcfg.completion_column)


def prepare(accelerator, model, optimizer, tcfg):
    """``(model, stepper, save_kwargs, load_kwargs)``: the model and optimizer prepared by
    Accelerate, the step's owner, and what a LoRA run's resume state saves and loads (the adapter,
    not a copy of the base). The loader is not prepared (it shards itself); neither is the
    scheduler, which Accelerate would step once per process for every optimizer step."""
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.lora import is_peft_model, keep_resume_state_to_adapter

    logger.info(
        "setting up %s on %d process(es) (a DeepSpeed ZeRO-3 start partitions the weights here)",
        accelerator.distributed_type,
        accelerator.num_processes,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    save_kwargs, load_kwargs = {}, {}
    if is_peft_model(accelerator.unwrap_model(model)):
        save_kwargs, load_kwargs = keep_resume_state_to_adapter(accelerator)
    stepper = OptimizerStepper(
        model, optimizer, accelerator, max_grad_norm=tcfg.max_grad_norm, nonfinite=tcfg.nonfinite
    )
    return model, stepper, save_kwargs, load_kwargs


def claim_and_resume(accelerator, ccfg, progress, loader, load_kwargs: dict) -> Path:
    """Take the run directory (a lock; its metrics are this run's) and, with
    ``checkpoint.resume_from``, load the training state the loop goes on from."""
    from nopad.training import checkpoint, run_dir

    output_dir = Path(ccfg.output_dir)
    run_dir.claim_run_dir(output_dir, accelerator, resuming=bool(ccfg.resume_from))
    if ccfg.resume_from:
        path = checkpoint.resume_training(accelerator, ccfg.resume_from, output_dir, load_kwargs, recipe="sft")
        if accelerator.is_main_process:
            checkpoint.trim_metrics(output_dir, progress.step + 1)  # SFT logs steps 1, 2, ...
        logger.info("resumed from %s at step %d (epoch %d)", path, progress.step, loader.epoch)
    return output_dir


def save_checkpoint(accelerator, model, tokenizer, ccfg, save_kwargs: dict, path: Path) -> None:
    """Checkpoint ``path``: the model directory (or LoRA adapter) with the resume state in it,
    ``checkpoint.keep_last`` applied. Here rather than a closure in :func:`train`, which binds it
    with ``functools.partial``, to keep that function readable in one screen."""
    from nopad.training import checkpoint

    checkpoint.save_training_checkpoint(
        accelerator,
        path,
        lambda d: save_model_dir(accelerator, model, tokenizer, d),
        ccfg.keep_last,
        save_kwargs,
        recipe="sft",
    )


def start_progress(accelerator, tcfg, dcfg, loader, step: int, max_steps: int):
    """Say what the loop is about to do from optimizer step ``step``: a warning when it has nothing
    left, the micro-batch progress bar (returned; None unless ``train.progress``, and on the local
    main process only) and a log line of the steps ahead. Kept out of :func:`train`'s loop."""
    from nopad.training import sft as sft_loop
    from nopad.training import sft_data

    gas = tcfg.grad_accum
    if step >= max_steps:
        logger.warning(
            "nothing to train: the run is already at optimizer step %d of %d (train.max_steps / "
            "train.epochs); raise them to train further",
            step,
            max_steps,
        )
    bar = sft_loop.progress_bar(
        tcfg.progress and accelerator.is_local_main_process,
        max_steps,
        step,
        gas,
        micro_batches=lambda n: sft_data.micro_batches(loader, gas, n, dcfg.streaming),
    )
    logger.info(
        "training %d optimizer step(s) of %d micro-batch(es) each (an epoch's last: what is left); "
        "the progress bar counts micro-batches (the first one is the slowest)",
        max(max_steps - step, 0),
        gas,
    )
    return bar


def train(cfg: SFTRecipeConfig, *, model=None, tokenizer=None, rows=None, accelerator=None) -> dict:
    """Run SFT as configured; returns ``{"losses": [...], "steps": n, "stats": [...], ...}``.

    ``model``/``tokenizer``/``rows`` override ``model.path``/``data.source`` (rows: token dicts
    with ``input_ids`` and optional ``labels``, or text rows with the prompt/completion columns;
    with ``data.per_turn_samples``, conversations in ``data.messages_column``).
    """
    import torch  # (imported here, not at the top, so that --help answers without torch)

    from nopad.training import sft as sft_loop
    from nopad.training import sft_data
    from nopad.training.accelerator import engine_info
    from nopad.training.curves import tracker_config

    tcfg, dcfg, ccfg = cfg.train, cfg.data, cfg.checkpoint
    accelerator = accelerator or make_accelerator(cfg)
    torch.manual_seed(tcfg.seed)
    model, tokenizer = model_to_train(cfg, model, tokenizer)
    rows = training_rows(dcfg, rows, tokenizer, model.config.vocab_size)
    gas = tcfg.grad_accum
    loader = sft_data.build_loader(dcfg, rows, accelerator, gas, model.config)
    steps = sft_data.total_steps(tcfg.max_steps, tcfg.epochs, dcfg, loader, gas)
    optimizer, scheduler = sft_loop.make_optimizer(model, tcfg.lr, tcfg.weight_decay, tcfg.warmup_steps, steps)
    model, stepper, save_kwargs, load_kwargs = prepare(accelerator, model, optimizer, tcfg)
    progress = sft_loop.Progress(
        {f"train.{k}": getattr(tcfg, k) for k in ("grad_accum", "lr", "weight_decay", "warmup_steps")}
    )
    info = engine_info(model, accelerator)
    logger.info("training with %s on %d process(es)", info, accelerator.num_processes)
    accelerator.init_trackers("nopad-sft", config=tracker_config(cfg.to_dict()))
    for obj in (progress, loader, scheduler):  # progress first: it names train.grad_accum on a mismatch
        accelerator.register_for_checkpointing(obj)
    output_dir = claim_and_resume(accelerator, ccfg, progress, loader, load_kwargs)
    save = partial(save_checkpoint, accelerator, model, tokenizer, ccfg, save_kwargs)
    max_steps = tcfg.max_steps or steps
    bar = start_progress(accelerator, tcfg, dcfg, loader, progress.step, max_steps)
    tick = None if bar is None else lambda: bar.update(1)
    losses, stats, seen = [], [], [] if cfg.log.record_indices else None
    saved_at = None
    while progress.step < max_steps:
        for window in sft_data.windows(loader, gas):
            step_loss = sft_loop.sft_step(
                stepper, window, tcfg.weighting, seen, step=progress.step + 1, on_micro_batch=tick
            )
            scheduler.step()
            progress.step += 1
            losses.append(sft_loop.record_step(accelerator, output_dir, progress.step, step_loss, bar))
            if ccfg.every and progress.step % ccfg.every == 0:
                save(output_dir / f"step_{progress.step}")
                saved_at = progress.step
            if progress.step >= max_steps:
                break
        if (last := sft_data.epoch_stats(loader)) is not None and last not in stats:
            stats.append(last)
    if bar is not None:
        bar.close()
    final = output_dir / f"step_{progress.step}"
    if ccfg.save_final and saved_at != progress.step:  # (decided the same way on every rank)
        save(final)
    accelerator.wait_for_everyone()
    result = {
        "losses": losses,
        "steps": progress.step,
        "stats": stats,
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        **info,
        "checkpoint": str(final) if ccfg.save_final else None,
        "micro_batches_per_epoch": None if dcfg.streaming else len(loader),
    }
    if seen is not None:
        result["indices_per_step"] = seen  # dataset rows of each micro-batch, in order
    sft_loop.write_result(accelerator, output_dir, result)
    return result


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_cli(SFTRecipeConfig, argv, "nopad.recipes.sft", __doc__)  # --help: before torch loads
    setup_logging()
    from nopad.training.host_memory import return_freed_memory

    return_freed_memory()  # freed activations go back to the OS, not into glibc's heap (bench_memory.py)
    return train(cfg)


def cli() -> None:
    """The ``nopad-sft`` console script: the recipe from any directory once nopad is installed."""
    run_recipe(main, "nopad.recipes.sft")


if __name__ == "__main__":
    cli()
