"""In-flight (continuous) batching generation on the live model, on the packing core.

    from nopad.inference import Generator, SamplingParams
    gen = Generator(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=2048)
    outs = gen.generate(prompts, SamplingParams(temperature=1.0, n=8, max_tokens=128, seed=0))
    outs[0].outputs[3].token_ids, outs[0].outputs[3].logprobs   # raw; GRPO scores .temperature_logprobs
    gen.release()                                                # hand the KV memory back

    episodes = gen.run_episodes(chats, tools=[add], sampling_params=params,
                                limits=EpisodeLimits(max_turns=4, max_tokens=512))
    episodes[0].completion_ids, episodes[0].model_mask          # tool tokens have mask 0

The pipeline, one module per concept: ``sampling_params`` (what to sample) -> ``request``
(validated requests, sequence state, the owners' ``SequenceHooks``) -> ``scheduler`` (plan a step
on the core ``BlockAllocator``) -> ``model_runner`` (the step's inputs and ``VarlenMeta`` from
``step_inputs``, one forward through ``nopad.packing.hf``'s attention, ``kv_cache`` holding the paged
K/V; ``live_model`` switches the model for it) -> ``sampler`` (draws keyed by ``seeding``, the rows'
parameters read by ``sampling_rows``) -> the scheduler's postprocess (append, stop, call the owner)
-> ``outputs``; ``generator`` ties them. A steady decode skips the per-row walk: ``decode_batch`` keeps
its rows' step state in arrays; ``overlap`` launches a step before the one before is read back.
The owners: ``plain_requests``, and ``episodes`` for multi-turn tool episodes (pause at a tool
call with the KV pinned, resume by prefilling the tool's tokens; ``episode_setup`` checks their
arguments); ``tools`` reads and writes tool calls in the chat template's format and runs them off
the decode loop.
``sharded`` runs the generator on DeepSpeed ZeRO-3 / FSDP2 models (gather-once or lockstep).
"""

import importlib

_EXPORTS = {
    "Episode": "nopad.inference.episode_types",
    "EpisodeLimits": "nopad.inference.episode_types",
    "Turn": "nopad.inference.episode_types",
    "EpisodeSession": "nopad.inference.generator_episodes",
    "Generator": "nopad.inference.generator",
    "CompletionOutput": "nopad.inference.outputs",
    "RequestOutput": "nopad.inference.outputs",
    "StreamDelta": "nopad.inference.outputs",
    "SamplingParams": "nopad.inference.sampling_params",
    "ChatTemplateTools": "nopad.inference.tools",
    "ToolCall": "nopad.inference.tools",
    "ToolFormat": "nopad.inference.tools",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Names are imported on first use, so that ``nopad.inference.sampling_params`` and ``nopad.inference.tools``
    (what a recipe's config checks and ``--help`` read) load without torch."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nopad.inference' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_EXPORTS)
