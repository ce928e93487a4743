"""The owner of plain requests' sequences (``add_request``, ``generate``, ``stream``): the
requests in flight, and the outputs of those that finished until the generator's step returns
them. It is their :class:`~nopad.inference.request.SequenceHooks`; tool episodes have
:class:`~nopad.inference.episodes.EpisodeRunner` instead."""

from __future__ import annotations

from nopad.inference.outputs import RequestOutput
from nopad.inference.request import Request, Sequence, Status
from nopad.inference.scheduler import Scheduler


class PlainRequests:
    """The owner (:class:`~nopad.inference.request.SequenceHooks`) of plain requests' sequences: the
    requests in flight, and the outputs of those that finished until :meth:`Generator.step`
    returns them."""

    def __init__(self, scheduler: Scheduler, tokenizer):
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.in_flight: dict[str, Request] = {}
        self.ready: list[RequestOutput] = []  # aborted/finished outputs not yet returned by step()

    def start(self, request: Request) -> Sequence:
        self.in_flight[request.request_id] = request
        return request.first_sequence(self)

    def forked(self, parent: Sequence, children: list[Sequence]) -> None:
        for seq in children:
            parent.request.samples[seq.index] = seq

    def turn_ended(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)  # a plain request's one turn is its completion
        self.stopped(seq)

    def stopped(self, seq: Sequence) -> None:
        request = seq.request
        request.num_finished += 1
        if request.finished:
            self.ready.append(self.output(request))

    def poll(self, block: bool) -> None:
        """Plain requests never pause."""

    def abort(self, request_id: str) -> bool:
        request = self.in_flight.get(request_id)
        if request is None or request.finished:
            return False
        for seq in request.samples:
            if seq is not None and seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
        request.num_finished = request.params.n
        self.ready.append(self.output(request))
        return True

    def abort_all(self) -> None:
        """Abort every request in flight and drop every output not yet returned."""
        for request_id in list(self.in_flight):
            self.abort(request_id)
        self.ready = []

    def output(self, request: Request) -> RequestOutput:
        self.in_flight.pop(request.request_id, None)
        detok = None
        if self.tokenizer is not None:

            def detok(ids, skip):
                return self.tokenizer.decode(ids, skip_special_tokens=skip)

        return request.output(detok)
