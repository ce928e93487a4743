"""The one place nopad marks a TRL trainer as vLLM-backed, and every TRL code path that opens.

TRL 1.16 applies its importance-sampling correction only when ``use_vllm=True``; with a
``rollout_func`` and no vLLM, the rollout's log-probs reach the loss only through the off-policy
mask. ``nopad_rollout_func(importance_sampling=True)`` therefore sets ``use_vllm``, ``vllm_mode``
and ``vllm_generation`` on the trainer (:func:`enable_importance_sampling`), and every branch of
TRL's ``GRPOTrainer`` on those flags then runs for a trainer that has no vLLM. :data:`VLLM_PATHS`
lists each one with what it does here; :func:`vllm_paths` reads them from the installed TRL's
source, and a trainer whose TRL has a path not in the list is refused (its test names it).
"""

from __future__ import annotations

import ast
import logging
from collections import Counter

from nopad.training.trl.compat import UntestedTRLError, function_tree, trl_methods

logger = logging.getLogger(__name__)

VLLM_FLAGS = ("use_vllm", "vllm_mode", "vllm_generation")
_INIT = "runs at construction, before the flags are set"
_IS = "the importance-sampling correction: what importance_sampling=True is for"
_SCORE = "GRPOTrainer._generate_and_score_completions"
_IS_ON = "self.use_vllm and self.vllm_importance_sampling_correction"
# (TRL method, the condition or call on a flag) -> what it does once the flags are set; one entry per place
VLLM_PATHS: tuple[tuple[str, str, str], ...] = (
    (
        "GRPOTrainer.__init__",
        "self.loss_type == 'vespo' and self.use_vllm and self.vllm_importance_sampling_correction",
        _INIT + " (enable_importance_sampling repeats its check)",
    ),
    ("GRPOTrainer.__init__", "self.use_vllm", _INIT),
    (
        "GRPOTrainer.__init__",
        "self.vllm_mode == 'server' and self.vllm_importance_sampling_correction and self.accelerator.is_main_process",
        _INIT,
    ),
    ("GRPOTrainer.__init__", "self.vllm_generation.vllm_client.get_server_info", _INIT),
    (
        "GRPOTrainer._generate_single_turn",
        "self.use_vllm",
        "TRL's own generation, not run: the rollout_func generates (and _LiveWeights.generate refuses)",
    ),
    ("GRPOTrainer._generate_single_turn", "self.vllm_generation.generate", "refused: _LiveWeights.generate"),
    ("GRPOTrainer._generate_single_turn", "self.vllm_generation.sync_weights", "not run (as above)"),
    (
        "GRPOTrainer._tool_call_loop",
        "self.use_vllm and self.vllm_mode == 'colocate'",
        "not run: the tool episodes replace the loop, and vllm_mode='server' keeps it off the vLLM engine",
    ),
    (
        "GRPOTrainer._generate",
        "self.use_vllm and self.state.global_step != self._last_loaded_step",
        "the weight sync before a rollout_func: _LiveWeights.sync_weights does nothing",
    ),
    ("GRPOTrainer._generate", "self.vllm_generation.sync_weights", "as above"),
    (
        _SCORE,
        "self.args.gradient_accumulation_steps % generate_every "
        "!= 0 or (self.use_vllm and self.vllm_importance_sampling_correction)",
        _IS + " (old log-probs)",
    ),
    (_SCORE, _IS_ON, _IS + " (the ratio)"),
    (_SCORE, _IS_ON, _IS + " (its sampling/* metrics)"),
    (_SCORE, _IS_ON, _IS + " (the ratio in the batch)"),
    (
        "GRPOTrainer._compute_loss",
        "self.use_vllm and self.vllm_importance_sampling_correction and (self.loss_type != 'vespo')",
        _IS + " (the ratio in the loss)",
    ),
)


def _reads_flag(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and n.attr in VLLM_FLAGS
        and isinstance(n.ctx, ast.Load)
        for n in ast.walk(node)
    )


def _vllm_call(node: ast.AST) -> bool:
    """``self.vllm_generation.<...>(...)``."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    while isinstance(func, ast.Attribute):
        if (
            isinstance(func.value, ast.Attribute)
            and func.value.attr == "vllm_generation"
            and isinstance(func.value.value, ast.Name)
            and func.value.value.id == "self"
        ):
            return True
        func = func.value
    return False


def vllm_paths(cls: type) -> list[tuple[str, str]]:
    """(method, condition or call) of every branch on a vLLM flag, and every call into
    ``self.vllm_generation``, in the TRL classes of ``cls``'s MRO."""
    paths = []
    for method, fn in trl_methods(cls).items():
        for node in ast.walk(function_tree(fn)):
            tests = [node.test] if isinstance(node, (ast.If, ast.While, ast.IfExp)) else []
            tests += node.ifs if isinstance(node, ast.comprehension) else []
            paths += [(method, ast.unparse(t)) for t in tests if _reads_flag(t)]
            if _vllm_call(node):
                paths.append((method, ast.unparse(node.func)))
    return paths


def unlisted_vllm_paths(cls: type) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(paths in this TRL that :data:`VLLM_PATHS` does not list, listed paths it no longer has)."""
    found, listed = Counter(vllm_paths(cls)), Counter((m, c) for m, c, _ in VLLM_PATHS)
    return sorted((found - listed).elements()), sorted((listed - found).elements())


class _LiveWeights:
    """Stands in for TRL's vLLM backend: the generator reads the live parameters, so there is
    nothing to sync; generating through TRL's vLLM path is not possible."""

    def sync_weights(self) -> None:
        return None

    def generate(self, *args, **kwargs):
        raise RuntimeError(
            "the nopad rollout_func generates (tool rounds included); TRL's vLLM generation path is not available"
        )


def enable_importance_sampling(trainer) -> None:
    """Make ``GRPOTrainer`` apply ``vllm_importance_sampling_correction`` to the rollout's log-probs.

    Marks the trainer as vLLM-backed with a no-op weight sync (the generator already reads the live
    weights), so TRL recomputes the old log-probs, builds the ratio from ours and logs
    ``sampling/sampling_logp_difference`` and ``sampling/importance_sampling_ratio``. Idempotent.
    """
    if isinstance(getattr(trainer, "vllm_generation", None), _LiveWeights):
        return
    new, gone = unlisted_vllm_paths(type(trainer))
    if new:
        raise UntestedTRLError(
            f"importance_sampling=True marks the trainer as vLLM-backed, and this TRL "
            f"branches on that where nopad has not looked: {new}. Install the tested TRL "
            "(nopad.training.trl.compat.TESTED_TRL) or drop the option"
        )
    if gone:
        logger.debug("this TRL no longer has these vLLM paths: %s", gone)
    if trainer.use_vllm:
        raise ValueError("importance_sampling=True is for rollouts without vLLM, but the trainer has use_vllm=True")
    if not trainer.vllm_importance_sampling_correction:
        logger.warning(
            "importance_sampling=True but GRPOConfig.vllm_importance_sampling_correction=False: "
            "TRL will not apply the correction"
        )
    elif trainer.loss_type == "vespo" and trainer.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
        # TRL's own check, which ran at construction while use_vllm was still False
        raise ValueError(
            f"VESPO loss with importance_sampling=True needs vllm_importance_sampling_mode "
            f"'token_truncate' or 'token_mask', got {trainer.vllm_importance_sampling_mode!r}"
        )
    trainer.vllm_generation = _LiveWeights()
    trainer._last_loaded_step = getattr(trainer.state, "global_step", 0)
    trainer.vllm_mode = "server"  # keeps TRL's tool loop off a colocated engine (the loop is replaced anyway)
    trainer.use_vllm = True
