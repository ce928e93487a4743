"""The generator's weights changing under it: streaming RL lets an optimizer step land between two
generator steps, on the parameters the generator reads (no copy). This is the owner of what that
means for the generator: the policy version stamped on every sampled token, and what becomes of the
KV cache that older weights wrote (``stale_kv``)."""

from __future__ import annotations

from nopad.inference.scheduler import Scheduler

STALE_KV = ("keep", "recompute")


class PolicyVersions:
    """``version``: optimizer steps reported so far (tokens sampled now carry it).

    ``stale_kv="keep"``: every sequence continues on the KV cache (and hybrid state) its older weights
    wrote, as PipelineRL and AReaL do, and new prompts may share cached blocks written by older
    weights. ``"recompute"``: every running or paused sequence re-prefills its prompt and completion
    with the new weights before its next token (its tokens and their recorded log-probs stay as they
    were sampled) and the prefix cache is dropped, so every token sampled at version v is computed
    from weights v alone (``recomputed`` counts those sequences)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.version = 0
        self.recomputed = 0

    def update(self, stale_kv: str, steps: int) -> None:
        if stale_kv not in STALE_KV:
            raise ValueError(f"stale_kv must be one of {STALE_KV}, got {stale_kv!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1 (the optimizer steps taken), got {steps!r}")
        self.version += steps
        if stale_kv == "recompute":
            self._recompute_in_flight()

    def _recompute_in_flight(self) -> None:
        scheduler = self.scheduler
        counts = scheduler.stats.preemptions, scheduler.stats.paused_preemptions
        for seq in reversed(list(scheduler.running)):  # the newest first: the queue keeps their order
            scheduler.preempt(seq)
        for seq in scheduler.paused:  # a paused episode recomputes when its tools return
            if seq.block_table:
                scheduler.preempt(seq)
        self.recomputed += scheduler.stats.preemptions - counts[0]
        # the scheduler's counters stay those of memory pressure; these are counted here
        scheduler.stats.preemptions, scheduler.stats.paused_preemptions = counts
        scheduler.allocator.reset_prefix_cache()
