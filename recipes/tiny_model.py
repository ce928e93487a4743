"""The recipes' tiny model: a random-weight Llama of 128 tokens and the one-token-per-character
tokenizer it reads (``model.path=tiny:llama``), so every recipe runs end to end in tests and smoke
runs without a download. Not a task: the task registry (:mod:`nopad.recipes.tasks`) says what to
train on, this says what trains."""

from __future__ import annotations

import json
from pathlib import Path


class AsciiTokenizer:
    """One token per ASCII character: a real, dependency-free tokenizer for the tiny random test
    models (vocab 128), so recipes run end to end without a hub download."""

    def __init__(self, eos_token_id: int = 2, vocab_size: int = 128):
        self.eos_token_id = eos_token_id
        self.pad_token_id = 0
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) for c in text]
        if any(i >= self.vocab_size for i in ids):
            raise ValueError(f"AsciiTokenizer only encodes characters below {self.vocab_size}: {text!r}")
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i >= 32 or i in (9, 10)]
        return "".join(chr(i) for i in ids)

    def __call__(self, text: str | list[str], add_special_tokens: bool = False) -> dict:
        if isinstance(text, str):
            return {"input_ids": self.encode(text)}
        return {"input_ids": [self.encode(t) for t in text]}

    # A model directory saved with this tokenizer carries this file; nopad.recipes.models.load_model reads
    # it back, so checkpoints of tiny:* models chain like any other model directory.
    SAVED_NAME = "nopad_ascii_tokenizer.json"

    def save_pretrained(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / self.SAVED_NAME).write_text(
            json.dumps({"eos_token_id": self.eos_token_id, "vocab_size": self.vocab_size})
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> AsciiTokenizer:
        return cls(**json.loads((Path(path) / cls.SAVED_NAME).read_text()))


def tiny_causal_lm(family: str = "llama", seed: int = 0):
    """A tiny random-weight causal LM for smoke runs and tests (no download)."""
    import torch
    import transformers

    if family != "llama":
        raise ValueError(f"model.path=tiny:{family}: only tiny:llama is built in")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).float(), None
