"""Run a child process in its own process group with a timeout, for tests whose child starts
children of its own (torchrun ranks, benchmark workers): on timeout the whole group is killed, so
no rank is left running, and the caller gets the output so far to report."""

from __future__ import annotations

import os
import signal
import subprocess


def run_in_group(cmd: list[str], timeout: float, **popen_kwargs) -> tuple[int | None, str, str]:
    """``(returncode, stdout, stderr)`` of ``cmd`` (text); ``returncode`` is None when it ran past
    ``timeout`` seconds and its process group was killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=popen_kwargs.pop("stderr", subprocess.PIPE),
                            text=True, start_new_session=True, **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err or ""
    return proc.returncode, out, err or ""
