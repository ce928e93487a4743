"""The sampler's memory: its ``(rows, vocab)`` scratch tensors, kept from step to step, and the host
lists it sends to the device without a sync. Shared by the draw (:mod:`nopad.inference.sampler`) and the
filters it draws through (:mod:`nopad.inference.sampling_filters`)."""

from __future__ import annotations

import torch

from nopad.packing.head.log_softmax import tempered_log_softmax


class SamplerBuffers:
    """The ``(rows, vocab)`` scratch tensors of a step's sampling, kept from step to step.

    Why: a step needs several rows x vocab tensors (fp32 logits, log-probs, tempered logits, a
    float64 CDF). Made fresh each step and freed at its end, the CPU allocator can hand them back
    to the OS and the next step faults them in again page by page (``benchmarks/bench_sampler.py``
    counts the faults and times both). The buffers hold the same values, computed by the same
    kernels (``out=`` and in-place variants)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        # each buffer's last view, by the shape it was asked for: a steady decode asks the same every step
        self._views: dict[str, tuple[tuple, torch.Tensor]] = {}

    def get(self, name: str, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Uninitialised memory of ``like``'s shape and device in ``dtype``, reused across calls."""
        key = (like.shape, like.device, dtype)
        view = self._views.get(name)
        if view is not None and view[0] == key:
            return view[1]
        numel = like.numel()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.device != like.device or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=like.device)
        self._views[name] = (key, buf[:numel].view(like.shape))
        return self._views[name][1]

    def clear(self) -> None:
        self._buffers.clear()
        self._views.clear()


def log_softmax_into(x: torch.Tensor, buffers: SamplerBuffers, name: str) -> torch.Tensor:
    """``log_softmax(x, -1)`` into a reused buffer, through the trainer's own expression
    (:func:`nopad.packing.head.log_softmax.tempered_log_softmax`), so the same kernel gives the same bits."""
    return tempered_log_softmax(x, out=buffers.get(name, x))


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without a sync: through pinned memory, non-blocking, on
    CUDA (a pageable copy waits for the work already queued, e.g. an overlapped forward)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
