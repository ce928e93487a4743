"""In-flight (continuous) batching generation on the live model, on the packing core."""
