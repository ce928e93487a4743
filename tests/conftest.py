"""Shared fixtures. Without CUDA, Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET``
is read when a kernel is decorated (``@triton.jit``, at its module's import), and conftest.py is
imported before any test module imports nopad, so setting it here reaches every kernel. A value the
caller set is kept (``TRITON_INTERPRET=0`` on a GPU machine is the caller's choice)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _single_thread():
    """Tiny tensors run faster on one thread, and CI's two cores are shared with other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


one_thread = pytest.fixture(_single_thread, name="one_thread")  # for a test
# for every test of a module: `pytestmark = pytest.mark.usefixtures("one_thread_module")`
one_thread_module = pytest.fixture(_single_thread, scope="module", name="one_thread_module")
