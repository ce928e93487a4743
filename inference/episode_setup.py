"""The arguments of :meth:`nopad.inference.Generator.run_episodes`, checked and resolved before any token
is generated: the limits, the tools (one mapping per prompt), the environments (made and reset),
the tool format (the chat template's by default) and the prompts rendered with the tools."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from nopad.inference.environments import reset_environments
from nopad.inference.episodes import EpisodeLimits
from nopad.inference.tools import ChatTemplateTools, ToolFormat


@dataclass
class EpisodeSetup:
    prompts: list  # token ids or strings, rendered with the tools: what make_requests takes
    tools: list[dict[str, Callable]]  # the tools of each prompt's episodes
    tool_format: ToolFormat
    limits: EpisodeLimits
    environments: list[list[object]] | None  # [prompt][sample], reset


def episode_setup(
    prompts,
    tools: Seq[Callable] | Mapping[str, Callable],
    sampling_params,
    tokenizer,
    *,
    limits: EpisodeLimits | None,
    tool_format: ToolFormat | None,
    environment_factory: Callable | None,
    prompt_tools: Seq[Mapping[str, Callable]] | None,
    reset_kwargs: Seq[Mapping] | None = None,
) -> EpisodeSetup:
    """Check and resolve ``run_episodes``' arguments (see there); bad ones raise here."""
    if getattr(sampling_params, "prompt_logprobs", None) is not None:
        raise ValueError("prompt_logprobs is for generate()/add_request(); an Episode does not return them")
    limits = limits if limits is not None else EpisodeLimits()
    if not isinstance(limits, EpisodeLimits):
        raise TypeError(f"limits must be an EpisodeLimits, got {type(limits).__name__}")
    named = named_tools(tools)
    environments, prompts = reset_environments(environment_factory, prompts, sampling_params, reset_kwargs)
    per_prompt = [named] * len(prompts)
    if prompt_tools is not None:
        per_prompt = [named_tools(t) for t in prompt_tools]
        if len(per_prompt) != len(prompts):
            raise ValueError(
                f"prompt_tools has {len(per_prompt)} entries for {len(prompts)} prompts; give one per prompt"
            )
    if tool_format is None:
        if tokenizer is None:
            raise ValueError("run_episodes needs a tokenizer (for the chat template's tool format) or tool_format=")
        tool_format = ChatTemplateTools(tokenizer, list(named.values()))
    return EpisodeSetup(render_prompts(prompts, tool_format), per_prompt, tool_format, limits, environments)


def named_tools(tools) -> dict[str, Callable]:
    """``{name: function}`` from a list of functions (named by ``__name__``) or a mapping."""
    if isinstance(tools, (str, bytes)) or callable(tools):
        raise TypeError(
            f"tools must be a list of functions or a {{name: function}} mapping, got {tools!r}; "
            "pass the functions themselves, e.g. tools=[add]"
        )
    if isinstance(tools, Mapping):
        named = dict(tools)
    else:
        named = {getattr(fn, "__name__", repr(fn)): fn for fn in tools}
    for name, fn in named.items():
        if not callable(fn):
            raise TypeError(f"tool {name!r} is {fn!r}, not a function")
    return named


def render_prompts(prompts, tool_format: ToolFormat) -> list:
    """Episode prompts as the generator takes them: chat messages rendered (with the tools) by
    the tool format, token ids and strings as they are."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
            if not hasattr(tool_format, "prompt_ids"):
                raise ValueError(
                    f"prompt {i} is chat messages but the tool format "
                    f"{type(tool_format).__name__} has no prompt_ids(); pass token ids"
                )
            prompt = tool_format.prompt_ids(list(prompt))
        out.append(prompt)
    return out
