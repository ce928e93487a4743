"""Fuzz the generator's request lifecycle: random arrivals, aborts, lengths and cache sizes.

Every request must finish exactly once with the right finish reason, the allocator must stay
consistent after every step, and end with every block free."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nopad.inference import Generator, SamplingParams
from tests.support.models import tiny_model

EOS = 2


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model("llama", num_hidden_layers=1)
    torch.set_num_threads(threads)


request_strategy = st.fixed_dictionaries(
    {
        "length": st.integers(1, 24),
        "max_tokens": st.integers(1, 12),
        "n": st.integers(1, 3),
        "arrive": st.integers(0, 6),
        "abort": st.one_of(st.none(), st.integers(0, 12)),
        "greedy": st.booleans(),
        "ignore_eos": st.booleans(),
        "shared_prefix": st.booleans(),
    }
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=10),
    block_size=st.sampled_from([1, 2, 4, 16]),
    cache_tokens=st.integers(16, 120),
    max_tokens_per_step=st.integers(1, 40),
    max_seqs=st.integers(3, 8),
    seed=st.integers(0, 1000),
)
def test_every_request_finishes_once_and_blocks_come_back(
    model, requests, block_size, cache_tokens, max_tokens_per_step, max_seqs, seed
):
    gen = Generator(
        model,
        block_size=block_size,
        num_blocks=max(cache_tokens // block_size, 2),
        max_num_batched_tokens=max_tokens_per_step,
        max_num_seqs=max_seqs,
    )
    capacity = gen.allocator.num_blocks * block_size
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 128, (16,), generator=g).tolist()  # exercises prefix-cache hits
    outputs, aborted, added = {}, set(), {}
    step = 0
    while step < 6 or gen.has_unfinished():
        for k, r in enumerate(requests):
            if r["arrive"] == step:
                prompt = torch.randint(3, 128, (r["length"],), generator=g).tolist()
                if r["shared_prefix"]:
                    prompt = (prefix + prompt)[: r["length"]]
                params = SamplingParams(
                    n=min(r["n"], max_seqs),
                    max_tokens=r["max_tokens"],
                    temperature=0.0 if r["greedy"] else 1.0,
                    seed=k,
                    ignore_eos=r["ignore_eos"],
                )
                if len(prompt) >= capacity:
                    with pytest.raises(ValueError, match="whole KV cache"):
                        gen.add_request(prompt, params)
                    continue
                added[gen.add_request(prompt, params, request_id=f"r{k}")] = r
            if r["abort"] == step and f"r{k}" in added and f"r{k}" not in outputs:
                assert gen.abort(f"r{k}")
                aborted.add(f"r{k}")
        for out in gen.step():
            assert out.request_id not in outputs, "finished twice"
            assert out.finished
            outputs[out.request_id] = out
        gen.allocator.check(owners=gen.scheduler.owners())
        step += 1
        assert step < 2000, "no progress"
    assert set(outputs) == set(added)
    for rid, out in outputs.items():
        r = added[rid]
        assert len(out.outputs) == min(r["n"], max_seqs)
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids) == len(c.token_times)
            if rid in aborted and c.finish_reason == "abort":
                assert len(c.token_ids) < r["max_tokens"] or c.token_ids[-1] != EOS
            elif c.token_ids and c.token_ids[-1] == EOS and not r["ignore_eos"]:
                assert c.finish_reason == "stop"
                assert EOS not in c.token_ids[:-1]
            else:
                assert c.finish_reason == "length", (c.finish_reason, c.token_ids)
                full = len(out.prompt_token_ids) + len(c.token_ids) >= capacity
                assert len(c.token_ids) == r["max_tokens"] or full
    assert gen.allocator.num_free == gen.allocator.num_blocks
    gen.allocator.check(owners=[])
