"""Multi-process test runs (torchrun, ``accelerate launch``, ``mp.spawn``) that say why a rank died.

A rank the kernel's OOM killer ends shows up in torchrun's report only as ``exitcode: -9``; these
helpers turn a rank that died by a signal into "rank N was killed by the OS (out of memory?)", so a
red test on a crowded machine points at memory, not at the code under test.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import pytest
import torch.multiprocessing as mp

# torchrun's failure report: "rank      : 1 (local_rank: 1)" then "exitcode  : -9 (pid: 123)"
_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for one launch's rendezvous (``--master_port``,
    ``--main_process_port``, ``MASTER_PORT``): a fixed port can still be held by another process or by
    the previous launch's socket in TIME_WAIT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _death(who: str, signum: int) -> str:
    if signum == signal.SIGKILL:
        return f"{who} was killed by the OS (out of memory?): SIGKILL"
    if signum == signal.SIGTERM:
        return f"{who} was stopped by SIGTERM (the launcher stops the other ranks when one fails)"
    return f"{who} died by {_signal_name(signum)}"


def signal_deaths(output: str, returncode: int | None = None) -> list[str]:
    """One line per process that died by a signal: each rank in torchrun's failure report, and
    the launcher itself when ``returncode`` is negative (``subprocess``'s "killed by signal")."""
    ranks = _RANK_EXIT.findall(output)
    deaths = [_death(f"rank {rank}", -int(code)) for rank, code in ranks if int(code) < 0]
    if returncode is not None and returncode < 0:
        deaths.append(_death("the launcher", -returncode))
    return sorted(set(deaths), key=lambda d: ("SIGKILL" not in d, d))


def failure_message(what: str, output: str, returncode: int, tail: int = 4000) -> str:
    """``what`` failed, the signal deaths first (if any), then the end of the output."""
    deaths = signal_deaths(output, returncode)
    head = f"{what} failed (exit {returncode})" + ("".join(f"\n  {d}" for d in deaths) if deaths else "")
    return f"{head}\n{output[-tail:]}"


def run(cmd: list[str], *, what: str, timeout: float, env: dict | None = None, cwd=None) -> str:
    """Run a multi-process command in its own process group and return its output (stdout and
    stderr together); fail the test with :func:`failure_message`, or after ``timeout`` s (killing
    the whole group, so no rank outlives the test)."""
    returncode, out, _ = run_in_group(cmd, timeout, cwd=cwd, env=env, stderr=subprocess.STDOUT)
    if returncode is None:
        pytest.fail(f"{what}: no result after {timeout:.0f} s - a rank is stuck (a deadlock or a hang)\n{out[-3000:]}")
    if returncode != 0:
        pytest.fail(failure_message(what, out, returncode))
    return out


def run_in_group(cmd: list[str], timeout: float, **popen_kwargs) -> tuple[int | None, str, str]:
    """``(returncode, stdout, stderr)`` of ``cmd`` (text), run in its own process group: on timeout
    the whole group (torchrun's ranks, a benchmark's workers) is killed and ``returncode`` is None."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=popen_kwargs.pop("stderr", subprocess.PIPE),
        text=True,
        start_new_session=True,
        **popen_kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err or ""
    except BaseException:  # pytest-timeout's failure, ^C: no rank outlives the test either
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc.returncode, out, err or ""


def spawn(fn, args: tuple, nprocs: int, timeout: float = 300) -> None:
    """``mp.spawn`` whose error says a rank was killed by the OS rather than a bare exit code, and
    that fails after ``timeout`` s (killing every rank) rather than hang the suite."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):  # raises when a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"no result after {timeout:.0f} s - a rank is stuck (a deadlock or a hang)")
    except mp.ProcessExitedException as err:
        if err.exit_code is not None and err.exit_code < 0:  # torch's spawn: -signal number
            pytest.fail(_death(f"rank {err.error_index}", -err.exit_code))
        raise
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join()
