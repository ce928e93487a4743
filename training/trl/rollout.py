"""A ready ``rollout_func`` for TRL's ``GRPOTrainer``: nopad's in-flight generator on the live policy.

    from nopad.training.trl.rollout import nopad_rollout_func
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=ds,
                          processing_class=tok, rollout_func=nopad_rollout_func())

What TRL (1.16) does with it: ``rollout_func(prompts, trainer)`` gets this process's prompts, each
already repeated ``num_generations`` times in a row by TRL's sampler, and must return one
completion per entry: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (lists per completion).
TRL keeps the log-probs as ``sampling_per_token_logps``; its loss uses them for the off-policy mask
(``off_policy_mask_threshold``) and - only when ``use_vllm=True`` - for the importance-sampling
correction (``vllm_importance_sampling_*``). ``importance_sampling=True`` here makes TRL apply that
correction to these log-probs too (see :func:`nopad.training.trl.vllm_state.enable_importance_sampling`).

Which log-probs: TRL scores a completion with ``log_softmax(logits / temperature)``, never
truncated. vLLM hands TRL *processed* log-probs (after top-p/top-k/min-p renormalisation), which
biases the ratio whenever those filters are on (TRL #6789). We return the log-prob of the sampled
token under exactly the trainer's distribution: the generator's ``temperature_logprobs``
(``softmax(logits / T)`` before repetition penalty and truncation), computed from the very
logits it sampled from - no second forward.

Consecutive identical prompts become one request with ``n`` samples, so a group's prompt is
prefilled once and its KV blocks are shared. The KV cache is released before returning, so the
backward pass gets the memory back; one ``Generator`` is reused across calls.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nopad.inference import chat
from nopad.inference.generator import Generator
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.sharded import ROLLOUT_MODES, sharded_generate
from nopad.packing.invariance import batch_invariant
from nopad.training.trl.compat import ToolLoopResult, check_grpo_trainer, hand_back_tool_loop
from nopad.training.trl.vllm_state import enable_importance_sampling

logger = logging.getLogger(__name__)

# GRPOConfig.generation_kwargs keys we can honour, mapped to SamplingParams fields
_GENERATION_KWARGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "min_tokens": "min_tokens",
    "stop": "stop",
    "stop_strings": "stop",
    "do_sample": None,
}


class NopadRollout:
    """``rollout_func(prompts, trainer) -> dict`` for ``GRPOTrainer``; build it with
    :func:`nopad_rollout_func`. ``generator_kwargs`` go to :class:`~nopad.inference.Generator`."""

    def __init__(
        self,
        *,
        importance_sampling: bool = False,
        batch_invariant: bool = False,
        autocast: bool = True,
        sharded_rollout: str = "gather",
        tool_timeout: float = 30.0,
        **generator_kwargs: Any,
    ):
        if sharded_rollout not in ROLLOUT_MODES:
            raise ValueError(
                f"sharded_rollout must be one of {ROLLOUT_MODES} (gather: full weights once per "
                f"rollout; lockstep: memory-lean), got {sharded_rollout!r}"
            )
        self.sharded_rollout = sharded_rollout
        if not isinstance(tool_timeout, (int, float)) or not tool_timeout > 0:
            raise ValueError(f"tool_timeout must be a number of seconds > 0, got {tool_timeout!r}")
        self.tool_timeout = float(tool_timeout)
        self.importance_sampling = importance_sampling
        self.batch_invariant = batch_invariant
        self.autocast = autocast
        self.generator_kwargs = generator_kwargs
        self.generator: Generator | None = None
        self.last_stats: dict = {}
        self.checked_trainers: set[type] = set()

    # ----------------------------------------------------------------- the hook TRL calls
    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if not prompts:
            raise ValueError("rollout_func got no prompts")
        if type(trainer) not in self.checked_trainers:  # once per trainer class: TRL's private names
            check_grpo_trainer(type(trainer))
            self.checked_trainers.add(type(trainer))
        if self.importance_sampling:
            enable_importance_sampling(trainer)
        if getattr(trainer, "tools", None):
            return self._episodes(prompts, trainer)
        prompt_ids = tokenize_prompts(prompts, trainer)
        params = sampling_params(trainer)
        groups = _runs(prompt_ids)  # (first index, count) of each run of identical prompts
        requests = [prompt_ids[i] for i, _ in groups]
        per_request = [_with_n(params, n) for _, n in groups]
        with unwrapped_policy(trainer) as model:
            generator = self._generator(model, trainer)
            with self._context(trainer):
                try:
                    # FSDP2: full weights once for the rollout, or ranks in lockstep (nopad.inference.sharded)
                    outputs = sharded_generate(generator, model, requests, per_request, mode=self.sharded_rollout)
                finally:
                    self.last_stats = generator.stats()
                    if not generator.has_unfinished():
                        generator.release()  # hand the KV memory to the backward pass
            completions = [c for out in outputs for c in out.outputs]
            completion_ids = [list(c.token_ids) for c in completions]
            logprobs = [list(c.temperature_logprobs) for c in completions]  # what TRL's trainer scores
        if len(completion_ids) != len(prompts):
            raise RuntimeError(f"generated {len(completion_ids)} completions for {len(prompts)} prompts; this is a bug")
        return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completion_ids, "logprobs": logprobs}

    # ----------------------------------------------------------------- tools and environments
    def _episodes(self, prompts: list, trainer) -> dict[str, list]:
        """TRL's ``tools`` / ``environment_factory`` run as nopad episodes: every tool round of
        every completion in this one call (a paused sequence keeps its KV, the others decode on),
        with the tools TRL bound for each entry (``_sync_tool_dicts`` / ``_async_tool_dicts``:
        the standalone tools plus the methods of that entry's own, already reset, environment).
        TRL's own ``_tool_call_loop`` would then run the last turn's calls again, so the trainer's
        loop is replaced by one that hands back what the episodes recorded (see
        :func:`nopad.training.trl.compat.hand_back_tool_loop`)."""
        from nopad.inference.episodes import EpisodeLimits
        from nopad.inference.tools import ChatTemplateTools

        if not (isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], dict)):
            raise ValueError("tool calling needs conversational prompts (lists of chat messages), as in TRL")
        prompt_ids = tokenize_prompts(prompts, trainer)
        tools = [{**trainer._sync_tool_dicts[i], **trainer._async_tool_dicts[i]} for i in range(len(prompts))]
        # entries with the same prompt and the same tools (no environment, or the same instance)
        # are one request with n samples: its prompt prefilled once, its blocks shared
        keys = [(tuple(ids), tuple(sorted(t.items(), key=lambda kv: kv[0]))) for ids, t in zip(prompt_ids, tools)]
        groups = _runs(keys)
        params = sampling_params(trainer)
        rounds = min(int(trainer.max_tool_calling_iterations), 2**31)  # TRL: sys.maxsize when unset
        limits = EpisodeLimits(max_turns=rounds + 1, max_tokens=params.max_tokens, tool_timeout=self.tool_timeout)
        tokenizer = _tokenizer(trainer)
        template = {"chat_template": trainer.chat_template} if getattr(trainer, "chat_template", None) else {}
        tool_format = ChatTemplateTools(
            tokenizer, list(trainer.tools), **template, **(getattr(trainer, "chat_template_kwargs", None) or {})
        )
        with unwrapped_policy(trainer) as model:
            generator = self._generator(model, trainer)
            with self._context(trainer):
                try:
                    episodes = generator.run_episodes(
                        [prompt_ids[i] for i, _ in groups],
                        sampling_params=[_with_n(params, n) for _, n in groups],
                        limits=limits,
                        tool_format=tool_format,
                        prompt_tools=[_trl_tools(tools[i]) for i, _ in groups],
                    )
                finally:
                    self.last_stats = {**generator.stats(), **generator.last_episode_stats}
                    if not generator.has_unfinished():
                        generator.release()
        if len(episodes) != len(prompts):
            raise RuntimeError(f"ran {len(episodes)} episodes for {len(prompts)} prompts; this is a bug")
        self.last_episodes = episodes
        completions = [episode_messages(ep, tokenizer, list(trainer.tools)) for ep in episodes]
        hand_back_tool_loop(
            trainer,
            ToolLoopResult(
                model_mask=[list(ep.model_mask) for ep in episodes],
                messages=completions,
                completion_ids=[list(ep.completion_ids) for ep in episodes],
                logprobs=[list(ep.temperature_logprobs) for ep in episodes],
                tool_calls=sum(ep.num_tool_calls for ep in episodes),
                tool_failures=sum(ep.num_tool_errors for ep in episodes),
                tool_images=[[] for _ in episodes],
            ),
        )
        return {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": [list(ep.completion_ids) for ep in episodes],
            "logprobs": [list(ep.temperature_logprobs) for ep in episodes],
        }

    # ----------------------------------------------------------------- pieces
    def _generator(self, model: torch.nn.Module, trainer) -> Generator:
        """One Generator for the run; a new one only if the trainer's model object changed."""
        if self.generator is None or self.generator.model is not model:
            kwargs = dict(self.generator_kwargs)
            batch = int(getattr(trainer.args, "generation_batch_size", 0) or 0)
            kwargs.setdefault("max_num_seqs", max(batch, 1))
            self.generator = Generator(model, _tokenizer(trainer), **kwargs)
        return self.generator

    def _context(self, trainer):
        stack = contextlib.ExitStack()
        if self.autocast:  # the same autocast TRL scores the completions under
            stack.enter_context(trainer.accelerator.autocast())
        stack.enter_context(batch_invariant(self.batch_invariant))
        return stack


def nopad_rollout_func(
    *,
    importance_sampling: bool = False,
    batch_invariant: bool = False,
    autocast: bool = True,
    sharded_rollout: str = "gather",
    tool_timeout: float = 30.0,
    **generator_kwargs: Any,
) -> NopadRollout:
    """A ``rollout_func`` for ``GRPOTrainer`` that generates with nopad in-process on the policy.

    ``generator_kwargs`` size the generator (``max_num_batched_tokens``, ``max_num_seqs``,
    ``kv_memory_bytes``, ``block_size``...). ``importance_sampling=True`` lets TRL apply its
    ``vllm_importance_sampling_correction`` to our log-probs; ``batch_invariant=True`` generates
    inside ``nopad.packing.batch_invariant()``; ``autocast`` generates under the trainer's autocast.
    ``sharded_rollout`` (FSDP2-sharded policies, :mod:`nopad.inference.sharded`): ``"gather"`` the full
    weights once for the rollout (default), or ``"lockstep"`` to keep them sharded.

    With the trainer's ``tools`` / ``environment_factory`` every completion is a multi-turn
    episode (:meth:`nopad.inference.Generator.run_episodes`): up to ``max_tool_calling_iterations``
    tool rounds within ``max_completion_length`` tokens, each round of calls given
    ``tool_timeout`` seconds; a tool that raises or times out becomes an error message the model
    reads and is counted in TRL's ``tools/failure_frequency``.
    """
    return NopadRollout(
        importance_sampling=importance_sampling,
        batch_invariant=batch_invariant,
        autocast=autocast,
        sharded_rollout=sharded_rollout,
        tool_timeout=tool_timeout,
        **generator_kwargs,
    )


# ----------------------------------------------------------------------------- episodes for TRL
def _trl_tools(tools: dict[str, Callable]) -> dict[str, Callable]:
    """TRL's tool contract: a tool may return any value, the model reads ``str(value)``."""

    def as_text(fn):
        if inspect.iscoroutinefunction(fn):

            async def call_async(**kwargs):
                return str(await fn(**kwargs))

            return call_async
        return lambda **kwargs: str(fn(**kwargs))

    return {name: as_text(fn) for name, fn in tools.items()}


def episode_messages(episode, tokenizer, tools: list) -> list[dict]:
    """An episode as the messages TRL's tool loop hands reward functions: each model turn parsed
    by TRL's ``parse_response`` (plain text when malformed), each tool result a tool message."""
    from trl.chat_template_utils import parse_response

    ids = list(episode.prompt_token_ids) + list(episode.completion_ids)
    offset, messages = len(episode.prompt_token_ids), []
    for turn in episode.turns:
        turn_ids = ids[offset + turn.start : offset + turn.end]
        messages.append(
            parse_response(tokenizer, turn_ids, prefix=ids[: offset + turn.start], tools=tools)
            if turn_ids
            else {"role": "assistant", "content": ""}
        )
        if turn.tool_end > turn.end:
            messages += [{"role": "tool", "name": c.name, "content": c.result} for c in turn.tool_calls]
    return messages


# ----------------------------------------------------------------------------- trainer settings
def unwrapped_policy(trainer):
    """The live policy module, the way TRL's own generation gets it: unwrapped from DDP/DeepSpeed,
    ZeRO-3 parameters gathered for the block (``args.ds3_gather_for_generation``), gradient
    checkpointing off while generating. FSDP2-sharded policies stay sharded here; the rollout
    gathers them (or steps in lockstep) through :func:`nopad.inference.sharded.sharded_generate`."""
    from trl.models import unwrap_model_for_generation

    return unwrap_model_for_generation(
        getattr(trainer, "model_wrapped", trainer.model),
        trainer.accelerator,
        gather_deepspeed3_params=getattr(trainer.args, "ds3_gather_for_generation", True),
        gradient_checkpointing_kwargs=getattr(trainer.args, "gradient_checkpointing_kwargs", None),
    )


def _tokenizer(trainer):
    processing_class = trainer.processing_class
    return getattr(processing_class, "tokenizer", processing_class)


def tokenize_prompts(prompts: list, trainer) -> list[list[int]]:
    """Token ids of each prompt the way ``GRPOTrainer`` tokenizes them: the chat template (with the
    trainer's ``chat_template``, ``tools`` and ``chat_template_kwargs``) for conversational
    prompts, the tokenizer's defaults for plain text."""
    tokenizer = _tokenizer(trainer)
    if isinstance(prompts[0], str):
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("mixed prompt types: give all prompts as strings or all as message lists")
        return [list(ids) for ids in tokenizer(text=list(prompts))["input_ids"]]
    if not (isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], dict)):
        raise ValueError(f"a prompt must be a string or a list of chat messages, got {type(prompts[0]).__name__}")
    kwargs = getattr(trainer, "chat_template_kwargs", None) or trainer.args.chat_template_kwargs

    def render(conversations, tools):  # nopad.inference.chat.render: the tokens SFT and the recipe give it
        template = getattr(trainer, "chat_template", None)
        return [
            chat.render(tokenizer, c, True, tools=tools, chat_template=template, **(kwargs or {}))
            for c in conversations
        ]

    if getattr(trainer, "environment_factories", None) is not None:  # each with its environment's tools
        names = trainer._batch_environments
        return [render([p], trainer._env_tools[name])[0] for p, name in zip(prompts, names)]
    return render(prompts, getattr(trainer, "tools", None))


def sampling_params(trainer) -> SamplingParams:
    """The trainer's generation settings as one ``SamplingParams`` (n is set per prompt group)."""
    args = trainer.args
    values = {
        "temperature": float(getattr(trainer, "temperature", args.temperature)),
        "top_p": float(getattr(trainer, "top_p", args.top_p) or 1.0),
        "top_k": int(getattr(trainer, "top_k", args.top_k) or 0),
        "min_p": float(getattr(trainer, "min_p", args.min_p) or 0.0),
        "repetition_penalty": float(getattr(trainer, "repetition_penalty", args.repetition_penalty) or 1.0),
        "max_tokens": int(getattr(trainer, "max_completion_length", args.max_completion_length)),
    }
    extra = getattr(args, "generation_kwargs", None) or {}
    unknown = sorted(k for k in extra if k not in _GENERATION_KWARGS)
    if unknown:
        raise ValueError(
            f"GRPOConfig.generation_kwargs has keys the nopad rollout cannot honour: {unknown}; "
            f"supported: {sorted(_GENERATION_KWARGS)}"
        )
    if extra.get("do_sample") is False:
        values["temperature"] = 0.0
    values.update({_GENERATION_KWARGS[k]: v for k, v in extra.items() if _GENERATION_KWARGS[k]})
    eos = getattr(trainer, "eos_token_ids", None)
    if eos is not None:
        values["stop_token_ids"] = sorted({int(t) for t in eos})
    if values["temperature"] == 0:
        raise ValueError("temperature=0 (greedy) makes every completion of a group the same; GRPO needs sampling")
    return SamplingParams(**values)


def _with_n(params: SamplingParams, n: int) -> SamplingParams:
    fields = {k: getattr(params, k) for k in params.__dataclass_fields__}
    return SamplingParams(**{**fields, "n": n})


def _runs(prompt_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive identical prompts."""
    runs: list[tuple[int, int]] = []
    for i, ids in enumerate(prompt_ids):
        if runs and list(prompt_ids[runs[-1][0]]) == list(ids):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
