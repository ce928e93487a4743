"""Packed-batch data loading for Accelerate and DeepSpeed training, on the packing core."""
