"""The GRPO recipe's checkpoints: what a checkpoint keeps beside the policy and optimizer
(:class:`GRPOProgress`), what a resume must not change, and writing ``output_dir/step_N`` and the
final policy (:class:`Checkpointer`)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from nopad.recipes.config import ConfigError
from nopad.recipes.grpo_config import GRPORecipeConfig
from nopad.recipes.models import save_model_dir
from nopad.training.progress import Progress

logger = logging.getLogger(__name__)
STREAM_FILE = "streaming_rank{rank}.pt"  # streaming rollouts in flight, one file per rank


class GRPOProgress(Progress):
    """What a GRPO checkpoint keeps beside the policy, optimizer and RNG: the GRPO steps done and the
    settings a resume must keep (:class:`nopad.training.progress.Progress`), the prompt order and the
    reference model's identity; a resume that changed any of them stops with one line."""

    def __init__(self, order: list[int], settings: dict, reference: dict | None):
        super().__init__(settings)
        self.order, self.reference = order, reference

    def state_dict(self) -> dict:
        return {**super().state_dict(), "order": self.order, "reference": self.reference}

    def check_resume(self, state: dict) -> None:
        if "order" not in state:
            raise ValueError(f"not a GRPO checkpoint's progress state: {state!r}")
        super().check_resume(state)
        if state["order"] != self.order:
            raise ValueError(
                "cannot resume: this run's prompts differ from the checkpoint's (task, "
                "task.seed or train.seed changed); resume with the same ones"
            )
        if state["reference"] != self.reference:
            raise ValueError(
                f"cannot resume: the KL reference model differs from the checkpoint's "
                f"({state['reference']} vs {self.reference}); resume with the model.path of the "
                "run that wrote it (the initial policy, not a checkpoint)"
            )


def resume_settings(cfg: GRPORecipeConfig) -> dict:
    """The settings a resume must keep: the loss, the optimizer (the checkpoint's AdamW state would
    silently restore its own lr and weight decay over a changed one), the mini-batching, the
    rollout's shape and which policy is trained."""
    keys = {f"loss.{k}": v for k, v in cfg.loss.to_dict().items()}
    for k in ("lr", "weight_decay", "num_iterations", "steps_per_generation", "old_logprobs", "seed"):
        keys[f"train.{k}"] = getattr(cfg.train, k)
    for k in ("prompts_per_step", "num_generations", "seed", "logprobs", "mode", "max_staleness", "stale_kv"):
        keys[f"rollout.{k}"] = getattr(cfg.rollout, k)
    return keys


def reference_identity(cfg: GRPORecipeConfig, ref_model) -> dict | None:
    """The KL reference model: where it came from and a digest of its weights (None without KL)."""
    import torch

    if ref_model is None:
        return None
    digest = hashlib.sha256()
    for name, tensor in sorted(ref_model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {"model.path": str(cfg.model.path), "sha256": digest.hexdigest()[:16]}


class Checkpointer:
    """``save(step)``: ``output_dir/step_N`` atomically, a model (or LoRA adapter) directory with the
    resume state in ``training_state/`` (:func:`nopad.training.checkpoint.save_training_checkpoint`);
    :meth:`start` takes the run directory and resumes, :meth:`finish` writes the policy."""

    def __init__(self, cfg: GRPORecipeConfig, accelerator, model, tokenizer, run: GRPOProgress):
        from nopad.training.lora import is_peft_model, keep_resume_state_to_adapter

        self.cfg, self.accelerator, self.model, self.tokenizer = cfg, accelerator, model, tokenizer
        self.stream = None  # streaming rollouts: their in-flight state is saved per rank beside the policy
        self.resumed: Path | None = None  # the checkpoint start() resumed from
        self.save_kwargs, self.load_kwargs = {}, {}
        if is_peft_model(accelerator.unwrap_model(model)):  # resume state: the adapter, not a base copy
            self.save_kwargs, self.load_kwargs = keep_resume_state_to_adapter(accelerator)

    def __call__(self, step: int) -> None:
        from nopad.training import checkpoint

        def save_model(d: Path) -> None:
            save_model_dir(self.accelerator, self.model, self.tokenizer, d)
            if self.stream is not None:  # every rank its own groups
                import torch

                torch.save(self.stream.state_dict(), d / STREAM_FILE.format(rank=self.accelerator.process_index))

        checkpoint.save_training_checkpoint(
            self.accelerator,
            Path(self.cfg.output_dir) / f"step_{step}",
            save_model,
            self.cfg.checkpoint.keep_last,
            self.save_kwargs,
            recipe="grpo",
        )

    def start(self, run: GRPOProgress) -> Path | None:
        """``output_dir`` (None without one), locked against a second run into it, and ``run`` at
        the resumed step with ``checkpoint.resume_from``."""
        from nopad.training import checkpoint, run_dir

        cfg, accelerator = self.cfg, self.accelerator
        out = Path(cfg.output_dir) if cfg.output_dir else None
        if out is not None:  # lock: two runs at once into one directory stop with the other's pid
            refuse_stale_policy(cfg)
            run_dir.claim_run_dir(out, accelerator, resuming=bool(cfg.checkpoint.resume_from))
        if cfg.checkpoint.resume_from:
            path = self.resumed = checkpoint.resume_training(
                accelerator, cfg.checkpoint.resume_from, out, self.load_kwargs, recipe="grpo"
            )
            if accelerator.is_main_process:
                checkpoint.trim_metrics(out, run.step)  # GRPO logs steps 0, 1, ...
            logger.info("resumed from %s at grpo step %d", path, run.step)
        return out

    def resume_stream(self, stream) -> None:
        """Give streaming rollouts what the resumed checkpoint saved of them (this rank's groups)."""
        import torch

        self.stream = stream
        if self.resumed is None or stream is None:
            return
        path = self.resumed / STREAM_FILE.format(rank=self.accelerator.process_index)
        if not path.is_file():
            raise ConfigError(
                "rollout.mode",
                f"is streaming but {self.resumed} holds no {path.name}: it was "
                "written by a rollout.mode=sync run (or another number of ranks); resume it with "
                "rollout.mode=sync",
            )
        stream.load_state_dict(torch.load(path, weights_only=False))

    def finish(self, step: int, saved_at: int | None) -> None:
        """The trained policy: the last checkpoint with ``checkpoint.every`` (then ``model.path=
        <output_dir>`` picks it), else a model (or LoRA adapter) directory at ``output_dir``."""
        out = Path(self.cfg.output_dir) if self.cfg.output_dir else None
        if out is not None and self.cfg.checkpoint.every:
            if saved_at != step:
                self(step)
            logger.info("the policy is %s/step_%d (load it with model.path=%s)", out, step, out)
        elif out is not None:  # model.path=<output_dir> in evaluate/grpo/SFT
            save_model_dir(self.accelerator, self.model, self.tokenizer, out)
            logger.info("saved the policy to %s (load it with model.path=%s)", out, out)


def refuse_stale_policy(cfg: GRPORecipeConfig) -> None:
    """With checkpoints, model.path=<output_dir> means its newest checkpoint; a policy an earlier run
    saved at the top of the directory would be picked instead."""
    top = {p.name for p in Path(cfg.output_dir).iterdir()} if Path(cfg.output_dir).is_dir() else set()
    if cfg.checkpoint.every and top & {"config.json", "adapter_config.json"}:
        raise ConfigError(
            "checkpoint.every",
            f"> 0 makes {cfg.output_dir}/step_N the policy, but "
            f"{cfg.output_dir} already holds a policy saved by an earlier run without "
            "checkpoints; use another output_dir",
        )
