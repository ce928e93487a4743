"""Tool latency counted in generator steps, not seconds, for the tool-episode tests.

A tool that sleeps a fixed time sees more or fewer steps pass depending on the machine's load, so
a test that needs paused episodes to be preempted (or decoding to go on while a tool runs) fails
on a loaded machine. :meth:`StepClock.wait` instead returns once the model has run ``steps`` more
forwards, or at once while the generator has nothing to run but waits on the tools (so no test
waits for a timeout). Load then changes nothing but the speed.
"""

from __future__ import annotations

import contextlib
import functools
import threading


class StepClock:
    def __init__(self, gen):
        self.gen, self.forwards, self.idle = gen, 0, False
        self.cond = threading.Condition()

    def _forward(self, *_) -> None:
        with self.cond:
            self.forwards += 1
            self.cond.notify_all()

    def _set_idle(self, idle: bool) -> None:
        with self.cond:
            self.idle = idle
            self.cond.notify_all()

    @contextlib.contextmanager
    def running(self):
        """Count the generator's forwards and see when it waits on tools, for the block."""
        scheduler = self.gen.scheduler
        poll = scheduler.poll_paused

        def poll_paused(block: bool) -> None:
            self._set_idle(block)  # block: every live episode waits on a tool, so let them return
            try:
                poll(block)
            finally:
                self._set_idle(False)

        handle = self.gen.model.register_forward_pre_hook(self._forward)
        scheduler.poll_paused = poll_paused
        try:
            yield self
        finally:
            handle.remove()
            del scheduler.poll_paused

    def wait(self, steps: int) -> int:
        """Block until ``steps`` more forwards ran (or the generator idles); returns how many ran."""
        with self.cond:
            start = self.forwards
            self.cond.wait_for(lambda: self.forwards >= start + steps or self.idle, timeout=20)
            return self.forwards - start

    def slow(self, tool, steps: int):
        """``tool`` returning ``steps`` generator steps after it is called."""

        @functools.wraps(tool)
        def slow_tool(*args, **kwargs):
            self.wait(steps)
            return tool(*args, **kwargs)

        return slow_tool
