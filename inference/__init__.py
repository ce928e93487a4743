"""In-flight (continuous) batching generation on the live model, on the packing core."""

from inference.generator import Generator
from inference.outputs import CompletionOutput, RequestOutput, StreamDelta
from inference.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "Generator", "RequestOutput", "SamplingParams", "StreamDelta"]
