"""return_freed_memory: freed blocks between live ones go back to the OS (glibc)."""

import ctypes.util
import platform
import subprocess
import sys

import pytest

# A fresh process: free one 16 MiB block (glibc then raises its mmap threshold past 4 MiB), then
# malloc 40 blocks of 4 MiB (a tensor's storage) with a live 256 KiB one after each and free the
# 4 MiB ones: the RSS they give back. Without the fixed threshold they sit on the heap between live blocks.
SCRIPT = """
import ctypes, sys
from nopad.training.host_memory import return_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def alloc(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)  # touched: resident
    return p
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
libc.free(alloc(16 << 20))
if sys.argv[1] == "1":
    assert return_freed_memory()
big, small = [], []
for _ in range(40):
    big.append(alloc(4 << 20))
    small.append(alloc(256 << 10))  # live, after it on the heap
before = rss()
for p in big:
    libc.free(p)
print(before - rss())
"""


def _returned(fixed: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "1" if fixed else "0"], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or "libc" not in str(ctypes.util.find_library("c")), reason="glibc's mallopt"
)
def test_freed_tensors_go_back_to_the_os():
    assert _returned(fixed=False) < 40 << 20  # glibc keeps them (the test would prove nothing otherwise)
    assert _returned(fixed=True) >= 150 << 20  # 40 x 4 MiB, all of it
