"""In-flight (continuous) batching generation on the live model, on the packing core.

    from inference import Generator, SamplingParams
    gen = Generator(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=2048)
    outs = gen.generate(prompts, SamplingParams(temperature=1.0, n=8, max_tokens=128, seed=0))
    outs[0].outputs[3].token_ids, outs[0].outputs[3].logprobs   # raw log-probs, for the trainer
    gen.release()                                                # hand the KV memory back

The pipeline, one module per concept: ``sampling_params`` (what to sample) -> ``request``
(sequence state) -> ``scheduler`` (plan a step on the core ``BlockAllocator``) ->
``model_runner`` (the step's ``VarlenMeta``, one forward through ``packing.hf``'s attention,
``kv_cache`` holding the paged K/V) -> ``sampler`` -> ``outputs``; ``generator`` ties them.
``sharded`` runs the generator on DeepSpeed ZeRO-3 / FSDP2 models (gather-once or lockstep).
"""

from inference.generator import Generator
from inference.outputs import CompletionOutput, RequestOutput, StreamDelta
from inference.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "Generator", "RequestOutput", "SamplingParams", "StreamDelta"]
