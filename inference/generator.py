"""The public in-flight batching generator, run in-process on the live HF model.

``Generator(model, tokenizer)`` borrows the model's parameters as they are (no copy: the next
training step's weights are used at once), switches its attention to nopad's paged varlen
implementation only while it generates (:mod:`nopad.inference.live_model`), and owns a paged KV cache
it allocates lazily and frees on :meth:`Generator.release`. Each :meth:`step` plans one varlen
forward (scheduler), runs it (model runner), and hands the logits to the scheduler's postprocess,
which samples, appends and calls each sequence's owner (plain requests or tool episodes) at its events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

import torch
from tqdm.auto import tqdm

from nopad.inference.decode_batch import DecodeBatch
from nopad.inference.episodes import EpisodeRunner
from nopad.inference.generator_episodes import EpisodeGeneration
from nopad.inference.generator_stats import generator_stats, reset_generator_stats
from nopad.inference.kv_cache import KVCache
from nopad.inference.live_model import LiveModel
from nopad.inference.model_runner import ModelRunner
from nopad.inference.outputs import RequestOutput, StreamDelta
from nopad.inference.overlap import Pipeline, pipelinable, resolve_overlap
from nopad.inference.plain_requests import PlainRequests
from nopad.inference.request import Request, Sequence
from nopad.inference.request_builder import RequestBuilder, eos_token_ids
from nopad.inference.sampler import Sampler
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.scheduler import Scheduler
from nopad.inference.sharded import refuse_plain_generation
from nopad.inference.state_prefix import make_state_slots, state_snapshots
from nopad.inference.step_plan import StepPlan
from nopad.inference.weight_updates import PolicyVersions
from nopad.packing.blocks import BlockAllocator
from nopad.packing.hf.rope import max_model_len

logger = logging.getLogger(__name__)

Prompt = str | Seq[int]


class Generator(EpisodeGeneration):
    """In-flight batching on any HF decoder whose attention goes through ``AttentionInterface``.

    ``max_num_batched_tokens`` is the token budget of one forward (decodes + prefill chunks),
    ``max_num_seqs`` the most sequences decoding at once. The KV cache holds ``num_blocks``
    blocks of ``block_size`` tokens, or as many as fit in ``kv_memory_bytes`` (default: 1 GiB,
    capped at what ``max_num_seqs`` sequences of the model's full length need).

    ``dtype`` (the KV cache's and attention's compute dtype; default: the autocast dtype of the
    first step, else the weights'), ``attn_backend``, ``block_size`` (default: what the backend
    reads in place), ``static_decode`` and ``compile_decode`` (bucketed, capturable decode
    steps): see :class:`nopad.inference.live_model.LiveModel`. ``num_state_snapshots``: the states a
    hybrid model's prefix cache keeps (:mod:`nopad.inference.state_prefix`). ``max_logprobs``: the most
    top log-probs a request may ask for per position (vLLM's cap and default; no vocabulary dicts).
    ``overlap``: launch each decode step before the last one is read back (default ``NOPAD_OVERLAP``,
    else off; :mod:`nopad.inference.overlap`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        block_size: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 128,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        num_state_snapshots: int | None = None,
        watermark: float = 0.01,
        dtype: torch.dtype | None = None,
        attn_backend: str | None = None,
        static_decode: bool = False,
        compile_decode: bool = False,
        max_logprobs: int = 20,
        overlap: bool | None = None,
    ):
        self.live = LiveModel(
            model, dtype=dtype, attn_backend=attn_backend, static_decode=static_decode, compile_decode=compile_decode
        )
        states = self.layer_states = self.live.layer_states
        block_size = block_size if block_size is not None else self.live.default_block_size()
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.model, self.tokenizer = model, tokenizer
        config = self.live.text_config  # a multimodal model's (Gemma3ForConditionalGeneration)
        self.max_model_len = max_model_len(config)  # under a LongRoPE switch, if any
        self.vocab_size = int(config.vocab_size)
        snapshots = state_snapshots(states, enable_prefix_caching, num_state_snapshots, max_num_seqs)
        num_blocks = self.live.num_kv_blocks(
            block_size, num_blocks, kv_memory_bytes, max_num_seqs, snapshots, self.max_model_len
        )
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.request_builder = RequestBuilder(
            tokenizer,
            self.vocab_size,
            self.max_model_len,
            num_blocks,
            block_size,
            max_num_seqs,
            self.eos_token_ids,
            max_logprobs,
        )
        self.allocator = BlockAllocator(num_blocks, block_size)
        slots = make_state_slots(states, max_num_seqs, snapshots, self.allocator)
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs,
            max_num_batched_tokens,
            watermark,
            enable_prefix_caching,
            state_slots=slots,
            max_model_len=self.max_model_len,
            tokenizer=tokenizer,
        )
        self._kv_cache: KVCache | None = None
        self._runner: ModelRunner | None = None
        self._plain = PlainRequests(self.scheduler, tokenizer)  # add_request/generate requests in flight
        self._episodes: EpisodeRunner | None = None  # the episodes of the open EpisodeSession, if any
        self.last_episode_stats: dict = {}
        self.versions = PolicyVersions(self.scheduler)  # stamped on every token; see update_weights()
        self.sampler = Sampler(lambda: self.versions.version)  # its rows x vocab scratch reused
        self.overlap = resolve_overlap(overlap)  # nopad.inference.overlap
        self.decode_batch = DecodeBatch(self.scheduler, self._forward, self.sampler, self.overlap, self.live)
        self.decode_batch.draws_in_graph = lambda: self._ensure_runner().draws_in_graph  # (the runner is lazy)
        self.pipeline = Pipeline(self.scheduler, self._forward, self.sampler.draw, self.decode_batch)

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one prompt; returns its request id. Bad input raises ValueError here."""
        request = self.request_builder.build(prompt, params, request_id, self._plain.in_flight)
        self._enqueue(request)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request; its output (finish_reason "abort") comes from the next step()."""
        return self._plain.abort(request_id)

    def request(self, request_id: str) -> Request | None:
        """The request in flight under ``request_id`` (its samples' tokens so far), or None."""
        return self._plain.in_flight.get(request_id)

    def abort_all(self) -> None:
        """Stop every request and episode in flight and drop their outputs (after an error)."""
        self._plain.abort_all()
        if self._episodes is not None:
            self._episodes.abort()
        self.pipeline.forget()  # every row in flight was aborted: nothing of it is kept

    def has_unfinished(self) -> bool:
        live = self._plain.in_flight or self.pipeline.busy
        return bool(live) or (self._episodes is not None and self._episodes.live > 0)

    def step(self) -> list[RequestOutput]:
        """Plan and run one forward, sample, and return the requests that finished (overlapped: a
        decode step completes in the next call). Episodes whose tools returned resume first; when
        nothing can run, wait for a tool (never spin). The sequences' owners act through hooks."""
        scheduler = self.scheduler
        scheduler.poll_paused(block=False)
        completing = self.pipeline.busy
        if self.pipeline.advance():  # step N+1 launched on N's draws, then N completed
            return self.take_finished()
        if self.decode_batch.serve():  # the same rows decoding: their arrays kept
            return self.take_finished()
        plan = scheduler.schedule()
        if plan.seqs and self.overlap and pipelinable(plan):
            self.pipeline.launch(plan)  # completed by the next call, once it has launched the next step
        elif plan.seqs:
            logits, rows = self._forward(plan)
            scheduler.postprocess(plan, rows, lambda index, seqs: self.sampler.sample(logits, index, seqs))
        elif scheduler.paused:  # all wait on tools: wait, don't spin (a completed step's outputs first)
            scheduler.poll_paused(block=not completing)
        elif (scheduler.has_work() or self.has_unfinished()) and not self._plain.ready:
            raise RuntimeError("the scheduler could not plan a step; this is a bug")
        return self.take_finished()

    def take_finished(self) -> list[RequestOutput]:
        """Outputs finished since :meth:`step` last returned (an :meth:`update_weights` can finish some)."""
        finished, self._plain.ready = self._plain.ready, []
        return finished

    def update_weights(self, stale_kv: str = "keep", steps: int = 1) -> None:
        """The trainer changed the weights in place (``steps`` optimizer steps) between two :meth:`step`
        calls: later tokens carry the new :attr:`policy_version`; ``stale_kv`` (keep | recompute) says
        what in-flight sequences do with the KV older weights wrote (:mod:`nopad.inference.weight_updates`)."""
        self.pipeline.drain()  # the step in flight ran on the old weights: its tokens carry the old version
        self.versions.update(stale_kv, steps)

    @property
    def policy_version(self) -> int:
        return self.versions.version

    # ----------------------------------------------------------------- high level
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params=None,
        use_tqdm: bool = True,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. Validates everything first.
        ``on_output(output)`` is called as each request finishes (a caller's own progress bar)."""
        refuse_plain_generation(self.model)
        requests = self.make_requests(prompts, sampling_params)
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm or len(requests) < 2) as bar:

            def finished(out: RequestOutput) -> None:
                bar.update(1)
                if on_output is not None:
                    on_output(out)

            return self.run(requests, on_output=finished)

    def run(
        self,
        requests: list[Request],
        *,
        step: Callable[[], list[RequestOutput]] | None = None,
        more: Callable[[], bool] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """The generate loop: queue ``requests`` (from :meth:`make_requests`), step until done,
        return their outputs in order. ``step`` / ``more`` replace :meth:`step` /
        :meth:`has_unfinished` for ranks in lockstep (:mod:`nopad.inference.sharded`). On any error every
        request in flight is aborted first, so a caller's ``release()`` works and the user sees the
        original error. Attention is switched to nopad (and eval mode) once per run, not per step."""
        step, more = step or self.step, more or self.has_unfinished
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            with self.live.attention():  # switched once for the run, restored after it (also on error)
                for request in requests:
                    self._enqueue(request)
                while more():
                    for out in step():
                        if out.request_id in order:
                            results[order[out.request_id]] = out
                        if on_output is not None:
                            on_output(out)
        except BaseException:
            self.abort_all()
            raise
        return results

    def stream(self, prompts: Prompt | Seq[Prompt], sampling_params=None) -> Iterator[StreamDelta]:
        """Yield the new tokens of every sample as they are produced (one delta per sample per
        step that produced tokens); the last delta of a sample carries its finish reason. The
        caller's code runs between deltas, so attention is switched per step here, not held."""
        refuse_plain_generation(self.model)
        live = self.make_requests(prompts, sampling_params)
        for request in live:
            self._enqueue(request)
        while live:
            try:
                self.step()
            except BaseException:
                self.abort_all()  # leave nothing in flight behind the error (see run())
                raise
            for request in live:
                yield from request.deltas()
            live = [request for request in live if not request.finished]

    def release(self, abort: bool = False) -> None:
        """Free the KV cache and sampler memory (e.g. before a training step); the next step
        re-allocates. ``abort=True`` first aborts what is in flight (cleanup after an error in a
        caller's own :meth:`step` loop; :meth:`generate` and :meth:`run` abort on their own)."""
        if abort:
            self.abort_all()
        if self.has_unfinished():
            raise RuntimeError(
                "release() with requests in flight; finish or abort them first (release(abort=True) aborts them)"
            )
        self._kv_cache = self._runner = None
        self.sampler.buffers.clear()
        self.allocator.reset_prefix_cache()

    def stats(self) -> dict:
        """Counters since construction or :meth:`reset_stats`."""
        return generator_stats(self)

    def reset_stats(self) -> None:
        reset_generator_stats(self)

    # ----------------------------------------------------------------- internals
    def make_requests(self, prompts, sampling_params=None) -> list[Request]:
        """Validate prompts and sampling parameters into requests for :meth:`run` (nothing is
        queued; bad input raises ValueError naming the prompt)."""
        if self.has_unfinished():
            raise RuntimeError(
                "generate()/stream() while add_request() requests are in flight; "
                "drive those with step() until has_unfinished() is False"
            )
        return self.request_builder.build_all(prompts, sampling_params, self._plain.in_flight)

    def _enqueue(self, request: Request, start: Callable[[Request], Sequence] | None = None) -> None:
        """Queue ``request``'s first sequence, made by its owner's ``start`` (plain by default)."""
        if not self._plain.in_flight and not self.scheduler.has_work() and not self.scheduler.paused:
            # idle: cached K/V may come from weights that have since been trained; drop it
            self.allocator.reset_prefix_cache()
        self.scheduler.add((start or self._plain.start)(request))

    def _forward(self, plan: StepPlan, ids_from=None, rows=None, draw=None) -> tuple:
        with self.live.attention(), self.live.autocast():
            return self._ensure_runner().run(plan, ids_from, rows, draw)

    def _ensure_runner(self) -> ModelRunner:
        if self._runner is None:
            s = self.scheduler
            shape = (self.allocator.num_blocks, self.block_size, s.state_slots, s.max_num_seqs, self.max_model_len)
            self._runner = self.live.build_runner(*shape)
            self._kv_cache = self._runner.kv_cache
        return self._runner
