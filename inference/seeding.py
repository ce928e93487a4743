"""Counter-based random streams: every draw of the generator is a pure function of its keys.

Sample ``i`` of a request with seed ``s`` (its ``stream``; an episode's fork has its own) draws
the token at position ``p`` from ONE uniform number ``u = mix(s, i, p) / 2**63`` (a splitmix64
hash, no generator state). The draw therefore depends on nothing else in the batch, and a
preempted sequence redraws the same tokens when it is recomputed. The scheduler (forks) and the
sampler (draws) both read these keys; neither imports the other.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` of every element of a uint64 array (its arithmetic wraps modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_seed(seed: int, index: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, sample index, token position)."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ index) ^ position) >> 1


def request_seed(seed: int | None) -> int:
    """The request's seed: the one given, else a host-side draw (whatever torch's default device)."""
    if seed is not None:
        return seed
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def fork_stream(stream: int, branch: int, position: int) -> int:
    """The random stream of branch ``branch`` of a sequence forked at ``position`` (branch 0
    keeps the parent's): a function of the history only, so forks are reproducible."""
    return counter_seed(stream, branch, position)


def uniform_draw(seq, ahead: int = 0) -> float:
    """The uniform number in [0, 1) of the next token of ``seq`` (an :class:`nopad.inference.request.
    Sequence`: its request's seed, its stream, its length, plus ``ahead`` tokens drawn on the device
    and not yet appended: an overlapped step's)."""
    return min(counter_seed(seq.request.seed, seq.stream, seq.num_tokens + ahead) / 2.0**63, 1.0 - 2.0**-40)


def stream_keys(seqs) -> np.ndarray:
    """Each sequence's key before its position is mixed in (uint64): the part of
    :func:`counter_seed` that is fixed for a sequence, worked out once for a batch that keeps decoding
    (:mod:`nopad.inference.decode_batch`)."""
    seeds = np.array([s.request.seed & _MASK64 for s in seqs], dtype=np.uint64)
    streams = np.array([s.stream for s in seqs], dtype=np.uint64)
    return _splitmix64_array(_splitmix64_array(seeds) ^ streams)


def uniform_array(keys: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    """:func:`uniform_draw` of every row at once (float64): ``keys`` from :func:`stream_keys`,
    ``num_tokens`` each sequence's length (int64). The same floats: the 63-bit integers are below 2**63,
    so int64 -> float64 rounds as Python's int -> float does, and the division by a power of two is exact."""
    x = _splitmix64_array(keys ^ num_tokens.astype(np.uint64)) >> np.uint64(1)
    return np.minimum(x.astype(np.int64).astype(np.float64) / 2.0**63, 1.0 - 2.0**-40)


def _int64_bits(c: int) -> int:
    """The int64 whose bits are the uint64 ``c``."""
    return c - (1 << 64) if c >> 63 else c


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift of int64 bits (torch's ``>>`` on int64 copies the sign bit in)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`_splitmix64` of every element of an int64 tensor holding uint64 bits: int64 addition and
    multiplication wrap modulo 2**64 as uint64's do, and the shifts are logical."""
    x = x + _int64_bits(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _int64_bits(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _int64_bits(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def uniform_tensor(keys: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """:func:`uniform_array` in torch ops, so a compiled decode step draws its uniforms itself
    (:mod:`nopad.inference.graph_sampler`): ``keys`` the rows' :func:`stream_keys` as int64 bits,
    ``num_tokens`` their lengths (int64). The same float64s, bit for bit (the tests hold it)."""
    x = _shift_right(_splitmix64_tensor(keys ^ num_tokens), 1)
    return torch.clamp(x.to(torch.float64) / 2.0**63, max=1.0 - 2.0**-40)


def uniform_draws(keys: np.ndarray, num_tokens: np.ndarray) -> list[float]:
    """:func:`uniform_array` as a list (the eager sampler's input)."""
    return uniform_array(keys, num_tokens).tolist()
