"""A stand-in for ``tqdm.auto.tqdm`` that records how a progress bar moves (a bar that
sat at 0/8 for 20 minutes, then jumped to 8/8)."""

from __future__ import annotations


class RecordingBar:
    bars: list[RecordingBar] = []

    def __init__(self, iterable=None, total=None, initial=0, desc=None, unit="it", disable=False, **_):
        self.total, self.initial, self.unit, self.disable, self.updates = total, initial, unit, disable, []
        RecordingBar.bars.append(self)

    def update(self, n=1):
        self.updates.append(n)

    def set_postfix(self, **_):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def record_bars(monkeypatch) -> list[RecordingBar]:
    """Replace ``tqdm.auto.tqdm`` (what nopad's recipes import where they draw a bar); returns the
    list that each new bar is appended to."""
    import tqdm.auto

    RecordingBar.bars = []
    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    return RecordingBar.bars
