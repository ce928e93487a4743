"""tests/support/launch.py: a rank that dies by a signal is named, with "killed by the OS (out of memory?)"
for SIGKILL (what the OOM killer sends), instead of torchrun's bare ``exitcode: -9``."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.support import launch

ROOT = Path(__file__).resolve().parents[2]

# torchrun 2.x's report when the OOM killer ended rank 1 (from a real run)
TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
nopad.recipes.sft FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_14:30:20
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 28036)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 28036
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_14:30:17
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 28038)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 28038
=======================================================
"""

KILL_RANK_1 = """\
import os, signal, time
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def test_torchrun_report_names_the_killed_rank_first():
    deaths = launch.signal_deaths(TORCHRUN_REPORT, returncode=1)
    assert deaths[0] == "rank 1 was killed by the OS (out of memory?): SIGKILL"
    assert deaths[1].startswith("rank 0 was stopped by SIGTERM")
    message = launch.failure_message("SFT under ZeRO-3", TORCHRUN_REPORT, 1)
    assert message.startswith("SFT under ZeRO-3 failed (exit 1)\n  rank 1 was killed by the OS (out of memory?)")
    assert launch.signal_deaths("Traceback ...\nValueError: bad", returncode=1) == []
    killed = "the launcher was killed by the OS (out of memory?): SIGKILL"
    assert launch.signal_deaths("", returncode=-9) == [killed]


@pytest.mark.timeout(300)  # the launch's own 120 s
def test_a_rank_killed_by_sigkill_under_torchrun_is_named(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(KILL_RANK_1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with pytest.raises(pytest.fail.Exception, match=r"rank 1 was killed by the OS \(out of memory\?\)"):
        launch.run(cmd, what="a rank that kills itself", timeout=120, env=env, cwd=ROOT)


def _kill_rank_1(rank: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(600)  # the spawn's own 300 s
def test_a_rank_killed_by_sigkill_under_mp_spawn_is_named():
    with pytest.raises(pytest.fail.Exception, match=r"^rank 1 was killed by the OS \(out of memory\?\)"):
        launch.spawn(_kill_rank_1, args=(), nprocs=2)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


class _Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise _Alarm


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_test_failed_while_it_waits_leaves_no_rank_behind(tmp_path):
    """pytest-timeout fails a test by raising from a SIGALRM handler: the launch's whole process group
    (here a shell and its child, as a launcher and its ranks) dies with it."""
    pid_file = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    before = signal.signal(signal.SIGALRM, _raise_alarm)
    signal.alarm(2)
    try:
        with pytest.raises(_Alarm):
            launch.run_in_group(cmd, timeout=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
