"""End-to-end tests of nopad.inference.Generator on tiny random-weight models: exactness against HF
generate and a plain forward, chunking, preemption, prefix sharing, n > 1, seeds, bad input."""

from __future__ import annotations

import logging

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from tests.support.models import tiny_model

FAMILIES = ("llama", "qwen2", "mistral")
GREEDY = dict(temperature=0.0)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def prompts_of(lengths, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens, **kwargs):
    """HF generate on one prompt alone (stops at EOS like ours); ``kwargs``: more of its options."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def forward_logprobs(model, prompt, completion):
    """Raw log-prob of each completion token from a training-style forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return lp[pos, torch.tensor(completion)]


LENGTHS = [1, 5, 17, 3, 40, 9]


@pytest.mark.parametrize("chunk", [1000, 3])
def test_greedy_matches_hf_generate(model, chunk):
    prompts = prompts_of(LENGTHS)
    gen = Generator(model, block_size=4, max_num_batched_tokens=chunk, num_blocks=128)
    outs = gen.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(model, prompt, 12)
        (c,) = out.outputs
        assert c.token_ids == ref
        assert c.finish_reason == ("stop" if ref[-1] == 2 else "length")
        assert out.finished and out.prompt_token_ids == prompt
    assert gen.allocator.num_free == gen.allocator.num_blocks
    gen.allocator.check(owners=[])
    if chunk == 3:
        assert max(gen.stats()["tokens_per_step"]) <= 3


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_greedy_matches_hf_generate_more_families(family):
    """Qwen3 (q/k norms) and Gemma2 (soft-capping, alternating sliding layers), chunked."""
    model = tiny_model(family)
    prompts = prompts_of(LENGTHS)
    gen = Generator(model, block_size=4, max_num_batched_tokens=5, num_blocks=128)
    outs = gen.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]


def test_logprobs_match_training_forward(model):
    prompts = prompts_of([7, 2, 19], seed=1)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True)
    outs = Generator(model, block_size=4, num_blocks=64).generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        ref = forward_logprobs(model, prompt, c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_preemption_keeps_greedy_output(llama):
    prompts = prompts_of([6, 11, 3, 8, 14], seed=2)
    gen = Generator(llama, block_size=2, num_blocks=24, max_num_batched_tokens=64)
    outs = gen.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY), use_tqdm=False)
    assert gen.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(llama, prompt, 16, min_new_tokens=16)
    gen.allocator.check(owners=[])
    assert gen.allocator.num_free == 24


def test_shared_prefix_reuses_blocks(llama):
    system = prompts_of([13], seed=3)[0]
    prompts = [system + tail for tail in prompts_of([1, 4, 6], seed=4)]
    gen = Generator(llama, block_size=4, num_blocks=64)
    first = gen.add_request(prompts[0], SamplingParams(max_tokens=6, **GREEDY))
    gen.step()  # prefills the first: its 3 full system blocks enter the prefix cache
    ids = [gen.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts[1:]]
    results = {}
    while gen.has_unfinished():
        for out in gen.step():
            results[out.request_id] = out
    assert gen.stats()["prefix_cache_hit_blocks"] == 6  # 3 blocks x 2 later requests
    assert gen.stats()["prefix_cache_hit_tokens"] == 24
    for rid, prompt in zip([first] + ids, prompts):
        assert results[rid].outputs[0].token_ids == hf_greedy(llama, prompt, 6)


def test_n_samples_share_prompt_prefilled_once(llama):
    prompt = prompts_of([10], seed=6)[0]  # 2 full blocks + a partial one shared by all samples
    gen = Generator(llama, block_size=4, num_blocks=64)
    (out,) = gen.generate([prompt], SamplingParams(n=3, max_tokens=8, **GREEDY), use_tqdm=False)
    ref = hf_greedy(llama, prompt, 8)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == ref for c in out.outputs)
    assert gen.stats()["prefill_tokens"] == len(prompt)
    gen.allocator.check(owners=[])

    # sampled: the samples diverge, and copy-on-write keeps each one's K/V its own
    gen = Generator(llama, block_size=4, num_blocks=64)
    params = SamplingParams(n=4, max_tokens=10, temperature=1.5, seed=3, ignore_eos=True)
    (out,) = gen.generate([prompt], params, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        torch.testing.assert_close(
            torch.tensor(c.logprobs), forward_logprobs(llama, prompt, c.token_ids), atol=1e-5, rtol=0
        )
    assert gen.stats()["prefill_tokens"] == len(prompt)


def test_seeded_request_is_batch_and_preemption_invariant(llama):
    prompt = prompts_of([9], seed=7)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    (alone,) = Generator(llama, block_size=4, num_blocks=64).generate([prompt], params, use_tqdm=False)
    others = prompts_of(list(range(2, 33)), seed=8)
    batch = [prompt] + others
    batch_params = [params] + [SamplingParams(max_tokens=20, temperature=1.0) for _ in others]
    gen = Generator(llama, block_size=4, num_blocks=512, max_num_batched_tokens=64)
    outs = gen.generate(batch, batch_params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[0].outputs[0].sampling_logprobs == pytest.approx(alone.outputs[0].sampling_logprobs, abs=1e-5)

    gen = Generator(llama, block_size=2, num_blocks=40, max_num_batched_tokens=64)
    pressure = SamplingParams(max_tokens=20, temperature=1.0, seed=9, ignore_eos=True)
    outs = gen.generate([others[20], prompt, others[5]], [pressure, params, pressure], use_tqdm=False)
    assert gen.stats()["preemptions"] > 0
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_sampling_logprobs_are_under_the_processed_distribution(llama):
    prompt = prompts_of([5], seed=9)[0]
    params = SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=0, ignore_eos=True, logprobs=3)
    (out,) = Generator(llama, block_size=4, num_blocks=32).generate([prompt], params, use_tqdm=False)
    c = out.outputs[0]
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = llama(ids).logits[0, len(prompt) - 1 : -1]
    scaled = logits / 0.7
    kth = scaled.topk(5).values[:, -1:]
    proc = torch.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    expected = proc[torch.arange(6), torch.tensor(c.token_ids)]
    torch.testing.assert_close(torch.tensor(c.sampling_logprobs), expected, atol=1e-5, rtol=0)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(c.top_logprobs) == 6
    for pos, top in enumerate(c.top_logprobs):
        best = raw[pos].topk(3)
        for tok, lp in zip(best.indices.tolist(), best.values.tolist()):
            assert top[tok] == pytest.approx(lp, abs=1e-5)
        assert c.token_ids[pos] in top
    assert c.first_token_time is not None and len(c.token_times) == 6


def test_stream_yields_the_generated_tokens(llama):
    prompts = prompts_of([4, 12], seed=10)
    params = SamplingParams(n=2, max_tokens=7, temperature=1.0, seed=4, ignore_eos=True)
    expected = Generator(llama, block_size=4, num_blocks=64).generate(prompts, params, use_tqdm=False)
    got, reasons = {}, {}
    for delta in Generator(llama, block_size=4, num_blocks=64).stream(prompts, params):
        assert (delta.request_id, delta.index) not in reasons, "delta after the finishing one"
        got.setdefault((delta.request_id, delta.index), []).extend(delta.token_ids)
        if delta.finish_reason:
            reasons[(delta.request_id, delta.index)] = delta.finish_reason
    assert len(reasons) == 4 and set(reasons.values()) == {"length"}
    for r, out in enumerate(expected):
        for c in out.outputs:
            assert got[(str(r), c.index)] == c.token_ids


def test_attention_setting_and_mode_restored_and_release(llama):
    llama.train()
    gen = Generator(llama, block_size=4, num_blocks=32)
    first = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert llama.config._attn_implementation == "sdpa" and llama.training
    llama.eval()
    gen.release()
    assert gen._kv_cache is None
    again = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_abort_and_low_level_loop(llama):
    gen = Generator(llama, block_size=4, num_blocks=64)
    a = gen.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    b = gen.add_request([8, 9], SamplingParams(max_tokens=3, ignore_eos=True, n=2), request_id="b")
    gen.step()
    assert gen.abort(a) and not gen.abort("nope")
    done = {}
    while gen.has_unfinished():
        for out in gen.step():
            assert out.request_id not in done
            done[out.request_id] = out
    assert done[a].outputs[0].finish_reason == "abort" and len(done[a].outputs[0].token_ids) == 1
    assert [c.finish_reason for c in done[b].outputs] == ["length", "length"]
    assert gen.allocator.num_free == 64
    gen.allocator.check(owners=[])


class CharTokenizer:
    """Token t <-> one character, enough to test stop strings and text."""

    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [ord(ch) - 32 for ch in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(t + 32) for t in ids)


def test_string_prompts_text_and_stop_strings(llama):
    tok = CharTokenizer()
    gen = Generator(llama, tok, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    (free_run,) = gen.generate("hello", params, use_tqdm=False)
    c = free_run.outputs[0]
    assert free_run.prompt == "hello" and free_run.prompt_token_ids == tok("hello")["input_ids"]
    assert c.text == tok.decode(c.token_ids)
    stop = c.text[3:5]
    (stopped,) = gen.generate(
        "hello", SamplingParams(max_tokens=10, ignore_eos=True, stop=stop, **GREEDY), use_tqdm=False
    )
    s = stopped.outputs[0]
    cut = c.text.find(stop)
    assert s.finish_reason == "stop" and s.text == c.text[:cut]
    assert s.token_ids == c.token_ids[: cut + len(stop)]


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], {}, "prompt is empty"),
        ("text", {}, "string prompts need a tokenizer"),
        ([1, 500], {}, "prompt token ids must be ints in [0, 128)"),
        (list(range(3, 100)) * 6, {}, "max_position_embeddings is 512"),
        (list(range(3, 100)), {}, "whole KV cache holds 64"),
        ([5], {"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ([5], {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ([5], {"top_p": 0.0}, "top_p must be in (0, 1]"),
        ([5], {"top_p": 1.5}, "top_p must be in (0, 1]"),
        ([5], {"n": 0}, "n must be >= 1"),
        ([5], {"stop": 7}, "stop must be a string or a list of strings"),
        ([5], {"stop": "x"}, "stop strings need a tokenizer"),
        ([5], {"max_tokens": 0}, "max_tokens must be >= 1"),
    ],
)
def test_bad_input_fails_that_request_only(llama, prompt, params, message):
    gen = Generator(llama, block_size=4, num_blocks=16)
    good = gen.add_request([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError) as err:
        gen.add_request(prompt, SamplingParams(**params))
    assert message in str(err.value)
    outs = []
    while gen.has_unfinished():
        outs += gen.step()
    assert [o.request_id for o in outs] == [good] and len(outs[0].outputs[0].token_ids) == 3
    if not params:  # a bad prompt fails generate() before anything runs
        with pytest.raises(ValueError, match="prompt 1: "):
            gen.generate([[5, 6], prompt], use_tqdm=False)
        assert not gen.has_unfinished() and gen.allocator.num_free == 16


def test_sequence_filling_the_whole_cache_stops_with_length(llama):
    prompt = prompts_of([9], seed=11)[0]
    gen = Generator(llama, block_size=4, num_blocks=4)  # 16 slots
    (out,) = gen.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 16 + 1 - 9
    ids = torch.tensor([prompt])
    ref = llama.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
    )[0, 9:].tolist()
    assert c.token_ids == ref
    assert gen.allocator.num_free == 4


def test_uses_the_live_weights():
    model = tiny_model("qwen2")
    prompt = prompts_of([12], seed=12)[0]
    gen = Generator(model, block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
    before = gen.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():  # a "training step": the generator must see it without any sync
        model.lm_head.weight.mul_(-1.0)
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # cached K/V is now stale
    after = gen.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = torch.tensor([prompt])
    ref = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
    )[0, 12:].tolist()
    assert after == ref and after != before
    assert gen.stats()["prefix_cache_hit_blocks"] == 0  # stale K/V from the old weights is not reused


def test_a_dict_of_sampling_settings_is_named_as_a_dict(llama):
    gen = Generator(llama, block_size=4, num_blocks=16)
    for call in (
        lambda: gen.generate(["hi"], {"temperature": 0}, use_tqdm=False),
        lambda: gen.generate([[5]], [{"temperature": 0}], use_tqdm=False),
        lambda: gen.add_request([5], {"temperature": 0}),
    ):
        with pytest.raises(TypeError, match=r"dict/mapping .*SamplingParams\(\*\*\{'temperature': 0\}\)"):
            call()
    assert not gen.has_unfinished()


def test_a_prompt_near_the_context_limit_says_why_it_stopped_early(caplog):
    from tests.support.models import tiny_model

    model = tiny_model("llama", max_position_embeddings=32)
    prompt = prompts_of([28], seed=3)[0]
    with caplog.at_level(logging.WARNING, logger="nopad.inference.generator"):
        (out,) = Generator(model, num_blocks=16).generate(
            [prompt], SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY), use_tqdm=False
        )
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert "stopped after 4 of max_tokens=50 new tokens" in caplog.text
    assert "context of 32 tokens" in caplog.text


def test_attention_is_switched_once_per_run_and_restored_also_on_error(llama, monkeypatch):
    """generate() switches the model to nopad attention and eval mode once, not per step,
    and gives it back as it was, also when a step raises; a bare step() switches for itself."""
    import nopad.inference.live_model as live_model

    entered = []
    real = live_model.use_nopad_attention

    def counting(model, **kwargs):
        entered.append(kwargs)
        return real(model, **kwargs)

    monkeypatch.setattr(live_model, "use_nopad_attention", counting)
    was_training = llama.training
    llama.train()
    before = llama.config._attn_implementation
    gen = Generator(llama, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=6, **GREEDY)
    gen.generate(prompts_of([3, 5, 9]), params, use_tqdm=False)
    steps = gen.stats()["steps"]
    assert steps > 3 and len(entered) == 1 and entered[0]["eval_mode"]
    assert llama.training and llama.config._attn_implementation == before

    def explode(module, args, kwargs):
        assert not module.training and module.config._attn_implementation == "nopad"
        raise RuntimeError("mid-run")

    handle = llama.register_forward_pre_hook(explode, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="mid-run"):
            gen.generate(prompts_of([4]), params, use_tqdm=False)
    finally:
        handle.remove()
    assert llama.training and llama.config._attn_implementation == before and not gen.has_unfinished()
    entered.clear()
    steps = gen.stats()["steps"]
    gen.add_request(prompts_of([4])[0], params)
    while gen.has_unfinished():
        gen.step()
    assert len(entered) == gen.stats()["steps"] - steps > 1 and llama.training
    llama.train(was_training)
