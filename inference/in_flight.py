"""Plain requests in flight as plain data, and back: what a checkpoint of streaming rollouts keeps of
the generator so that a killed run resumes the same sequences (:mod:`nopad.training.streaming`).

A request is saved with its sampling parameters and seed and, per sample, the tokens, log-probs and
policy versions recorded so far. Restored, every unfinished sample is queued to re-prefill its
prompt and completion (as a preempted sequence is), in the order the scheduler held them, so the
next steps plan and sample exactly as they would have: each draw is keyed by the request's seed,
the sample's stream and the token's position, never by the step.
"""

from __future__ import annotations

from nopad.inference.request import Sequence, Status

# what a sample keeps across a checkpoint; the rest (blocks, state slot, owner) is rebuilt
SAMPLE_FIELDS = (
    "index",
    "token_ids",
    "fork_count",
    "stream",
    "status",
    "finish_reason",
    "stop_text",
    "logprobs",
    "temperature_logprobs",
    "sampling_logprobs",
    "top_logprobs",
    "policy_versions",
    "token_times",
    "turn_start",
    "max_generated",
)


def save_requests(generator, request_ids: list[str]) -> dict:
    """The requests ``request_ids`` (plain requests in flight) and the scheduler's order of their
    live samples, as picklable data. An overlapped step in flight must be completed first
    (``generator.pipeline.drain()``): its draws are not in the sequences yet."""
    if generator.pipeline.busy:
        raise RuntimeError("save_requests() with an overlapped step in flight; call generator.pipeline.drain() first")
    requests = []
    for request_id in request_ids:
        request = generator.request(request_id)
        samples = [None if s is None else {k: _copy(getattr(s, k)) for k in SAMPLE_FIELDS} for s in request.samples]
        requests.append(
            {
                "request_id": request_id,
                "prompt_token_ids": list(request.prompt_token_ids),
                "params": request.params,
                "seed": request.seed,
                "num_finished": request.num_finished,
                "samples": samples,
            }
        )
    scheduler = generator.scheduler
    wanted = set(request_ids)
    order = [
        (s.request.request_id, s.index)
        for s in (*scheduler.running, *scheduler.waiting)
        if s.request.request_id in wanted
    ]
    return {"requests": requests, "order": order}


def restore_requests(generator, saved: dict) -> None:
    """Put :func:`save_requests`' requests back in flight on ``generator`` (idle: nothing else in
    flight), each unfinished sample queued to recompute its tokens, in the saved order."""
    if generator.has_unfinished():
        raise RuntimeError("restoring requests into a generator with requests in flight")
    plain, live = generator._plain, {}
    for state in saved["requests"]:
        if state["params"].prompt_logprobs is not None:
            raise ValueError("a checkpoint of requests with prompt_logprobs is not supported")
        request = generator.request_builder.build(
            state["prompt_token_ids"], state["params"], state["request_id"], plain.in_flight
        )
        request.seed, request.num_finished = state["seed"], state["num_finished"]
        request.samples = [None if s is None else _sequence(request, s, plain) for s in state["samples"]]
        plain.in_flight[request.request_id] = request
        for seq in request.samples:
            if seq is not None:
                live[(request.request_id, seq.index)] = seq
    for key in saved["order"]:
        seq = live.pop(tuple(key))
        if seq.status is not Status.FINISHED:
            seq.status = Status.WAITING
            generator.scheduler.add(seq)
    for seq in live.values():  # finished samples are kept for their request's output only
        if seq.status is not Status.FINISHED:
            raise ValueError(
                f"request {seq.request.request_id} sample {seq.index} is live but was not in "
                "the saved scheduler order; the checkpoint is inconsistent"
            )


def _sequence(request, state: dict, hooks) -> Sequence:
    return Sequence(request=request, hooks=hooks, **{k: _copy(v) for k, v in state.items()})


def _copy(value):
    return list(value) if isinstance(value, list) else value
