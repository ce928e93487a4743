"""The environments of :meth:`nopad.inference.Generator.run_episodes`: ``environment_factory`` builds one
per sample of each prompt, and each is reset before its episode starts, as TRL's GRPOTrainer does
(``reset(**example)``, the observation it returns joining the prompt). A factory or ``reset`` that
fails is an error naming it, before any token is generated: a ``reset`` never called, or a
factory returning None, would otherwise leave every tool call an "unknown tool" without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def reset_environments(
    factory: Callable | None, prompts, sampling_params=None, reset_kwargs: Sequence[Mapping] | None = None
) -> tuple[list | None, list]:
    """``(environments, prompts)``: one environment per sample of each prompt (``[prompt][sample]``,
    ``n`` from the sampling parameters), each reset as TRL's GRPOTrainer resets it:
    ``reset(**example)``: ``reset_kwargs[i]`` (the example's fields, as the recipe passes them) or
    ``reset(prompt=prompt)``; an observation it returns is appended to the prompt as TRL appends it
    (to the last message's content; a text prompt's end). A prompt's samples share its prefill
    (and are one GRPO group), so their observations must agree."""
    prompts = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
    if factory is None:
        return None, prompts
    if reset_kwargs is not None and (
        len(reset_kwargs) != len(prompts) or not all(isinstance(k, Mapping) for k in reset_kwargs)
    ):
        raise ValueError(
            f"reset_kwargs must be one mapping of reset() keywords per prompt ({len(prompts)}), "
            f"got {len(reset_kwargs)} entries; pass each prompt's example"
        )
    if not callable(factory):
        raise TypeError(
            f"environment_factory must be a class or function that returns a new environment "
            f"(its public methods are the tools), got {factory!r} ({type(factory).__name__})"
        )
    per_prompt = (
        list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    )
    environments, out = [], []
    for i, prompt in enumerate(prompts):
        n = getattr(per_prompt[i] if i < len(per_prompt) else None, "n", 1)
        group = [factory() for _ in range(n if isinstance(n, int) and n > 0 else 1)]
        if any(env is None for env in group):
            name = getattr(factory, "__qualname__", factory)
            raise TypeError(
                f"environment_factory {name!r} returned None (every tool call would be an "
                "unknown tool); it must return a new environment object whose public methods are "
                "the tools"
            )
        kwargs = dict(reset_kwargs[i]) if reset_kwargs is not None else {"prompt": prompt}
        observations = [_reset(env, kwargs, i, k) for k, env in enumerate(group)]
        if any(o != observations[0] for o in observations):
            raise ValueError(
                f"the environments of prompt {i}'s {len(group)} samples returned different "
                f"observations from reset() ({observations[0]!r} and others); the samples of a "
                "prompt share it (one GRPO group), so reset must depend only on the prompt"
            )
        environments.append(group)
        out.append(_with_observation(prompt, observations[0], i))
    return environments, out


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _reset(env, kwargs: dict, i: int, k: int) -> str | None:
    reset = getattr(env, "reset", None)
    if reset is None:
        return None
    name = f"{type(env).__qualname__}.reset"
    keys = ", ".join(f"{key}=..." for key in kwargs)
    try:
        observation = reset(**kwargs)
    except Exception as err:
        raise RuntimeError(
            f"environment {name}({keys}) raised {type(err).__name__}: {err} (prompt {i}, "
            f"sample {k}); it is called as TRL calls it, with the example's fields as "
            f"keywords (here: {', '.join(kwargs)})"
        ) from err
    if observation is not None and not isinstance(observation, str):
        raise TypeError(
            f"environment {name}() returned {type(observation).__name__}; return the observation "
            "as a string (it is appended to the prompt) or None"
        )
    return observation


def _with_observation(prompt, observation: str | None, i: int):
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    if (
        isinstance(prompt, (list, tuple))
        and prompt
        and isinstance(prompt[-1], Mapping)
        and isinstance(prompt[-1].get("content"), str)
    ):
        return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]
    raise ValueError(
        f"environment reset() returned an observation for prompt {i}, which is not text or chat "
        "messages with text content; pass one of those so the observation can join it (as TRL "
        "does), or return None from reset"
    )
