"""In-flight (continuous) batching generation on the live model, on the packing core.

    from inference import Generator, SamplingParams
    gen = Generator(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=2048)
    outs = gen.generate(prompts, SamplingParams(temperature=1.0, n=8, max_tokens=128, seed=0))
    outs[0].outputs[3].token_ids, outs[0].outputs[3].logprobs   # raw log-probs, for the trainer
    gen.release()                                                # hand the KV memory back

    episodes = gen.run_episodes(chats, tools=[add], sampling_params=params,
                                limits=EpisodeLimits(max_turns=4, max_tokens=512))
    episodes[0].completion_ids, episodes[0].model_mask          # tool tokens have mask 0

The pipeline, one module per concept: ``sampling_params`` (what to sample) -> ``request``
(sequence state) -> ``scheduler`` (plan a step on the core ``BlockAllocator``) ->
``model_runner`` (the step's ``VarlenMeta``, one forward through ``packing.hf``'s attention,
``kv_cache`` holding the paged K/V) -> ``sampler`` -> ``outputs``; ``generator`` ties them.
``episodes`` runs multi-turn tool episodes (pause at a tool call with the KV pinned, resume by
prefilling the tool's tokens); ``tools`` reads and writes tool calls in the chat template's format
and runs them off the decode loop.
``sharded`` runs the generator on DeepSpeed ZeRO-3 / FSDP2 models (gather-once or lockstep).
"""

from inference.episodes import Episode, EpisodeLimits, Turn
from inference.generator import Generator
from inference.outputs import CompletionOutput, RequestOutput, StreamDelta
from inference.sampling_params import SamplingParams
from inference.tools import ChatTemplateTools, ToolCall, ToolFormat

__all__ = ["ChatTemplateTools", "CompletionOutput", "Episode", "EpisodeLimits", "Generator", "RequestOutput",
           "SamplingParams", "StreamDelta", "ToolCall", "ToolFormat", "Turn"]
