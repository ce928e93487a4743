"""Thin scripts over the library: demo, preprocessing, SFT, GRPO, evaluation."""
