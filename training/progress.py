"""What a checkpoint keeps of a run beside the model, optimizer and RNG: the steps done and the
settings a resume must keep. SFT and GRPO register one with the Accelerator, so it is saved in
``step_N/training_state`` and restored (and compared) by ``load_state``."""

from __future__ import annotations


class Progress:
    """The optimizer (SFT) or GRPO steps done, and ``settings`` (``{"train.lr": 1e-3, ...}``): the
    values a resume must not change. The optimizer's saved state would silently win over a changed
    learning rate or weight decay, and another accumulation, loss or rollout shape makes another run;
    a resume that changed one stops naming it. A setting an older checkpoint did not record is not
    compared. Subclasses compare more in :meth:`check_resume`."""

    def __init__(self, settings: dict | None = None):
        self.step = 0
        self.settings = dict(settings or {})

    def state_dict(self) -> dict:
        return {"step": self.step, "settings": self.settings}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError(f"not a training progress state: {state!r}")
        self.check_resume(state)
        self.step = int(state["step"])

    def check_resume(self, state: dict) -> None:
        """Refuse a checkpoint made with other settings, naming the first that differs."""
        saved = dict(state.get("settings", {}))
        if "grad_accum" in state:  # an SFT checkpoint from before grad_accum was among the settings
            saved.setdefault("train.grad_accum", state["grad_accum"])
        changed = sorted(k for k in self.settings if k in saved and saved[k] != self.settings[k])
        if changed:
            key = changed[0]
            raise ValueError(
                f"cannot resume: the checkpoint was made with {key}={saved[key]!r} but this run "
                f"has {key}={self.settings[key]!r}; resume with the same value, or start a new "
                "run in another output directory"
            )
