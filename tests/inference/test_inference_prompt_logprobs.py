"""``SamplingParams(prompt_logprobs=k)``: every prompt token's log-prob and the top-k
at its position equal a full forward's log-softmax over the prompt, through chunked prefill, n > 1,
a prefix the cache would serve, preemption mid-prompt and a hybrid model, and the trainer's chunked
head bit for bit in batch_invariant(); requests that do not ask get None and keep no extra logits."""

from __future__ import annotations

import pytest
import torch

from nopad.inference import Generator, SamplingParams, prompt_logprobs
from nopad.packing.head.chunked import token_logprobs
from nopad.packing.hf import use_nopad_attention
from nopad.packing.invariance import batch_invariant
from nopad.packing.row import IGNORE_INDEX, PackedRow
from nopad.packing.varlen import VarlenMeta
from tests.inference.test_inference_generator import prompts_of
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest

GREEDY = dict(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def reference(model, prompt, k):
    """vLLM's shape from one forward of the whole prompt: None, then {prompt token: lp, top-k...}."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out = [None]
    for j in range(1, len(prompt)):
        vals, ids = lp[j - 1].topk(k)
        entry = dict(zip(ids.tolist(), vals.tolist()))
        entry.setdefault(prompt[j], lp[j - 1, prompt[j]].item())
        out.append(entry)
    return out


def assert_prompt_logprobs(got, expected, atol=1e-5):
    assert got is not None and len(got) == len(expected) and got[0] is None
    for position, (g, e) in enumerate(zip(got[1:], expected[1:]), start=1):
        assert g.keys() == e.keys(), f"position {position}: tokens {sorted(g)} != {sorted(e)}"
        for token in e:
            assert abs(g[token] - e[token]) <= atol, f"position {position}, token {token}"


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("chunk", [1000, 3])
def test_prompt_logprobs_equal_a_full_forward(llama, k, chunk, monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "CHUNK_TOKENS", 5)  # head chunks that divide no prompt
    prompts = prompts_of([1, 5, 17, 9])
    params = [SamplingParams(prompt_logprobs=k, **GREEDY), SamplingParams(**GREEDY)] * 2
    gen = Generator(llama, block_size=4, num_blocks=64, max_num_batched_tokens=chunk)
    outs = gen.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None  # a request that does not ask gets nothing
        else:
            assert_prompt_logprobs(out.prompt_logprobs, reference(llama, prompt, k))
    plain = Generator(llama, block_size=4, num_blocks=64, max_num_batched_tokens=chunk).generate(
        prompts, SamplingParams(**GREEDY), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    if chunk == 3:
        assert max(gen.stats()["tokens_per_step"]) <= 3


def test_n_samples_share_one_scored_prompt(llama):
    prompt = prompts_of([11])[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=2)
    (out,) = Generator(llama, block_size=4, num_blocks=64, max_num_batched_tokens=4).generate(
        [prompt], params, use_tqdm=False
    )
    assert len(out.outputs) == 3
    assert_prompt_logprobs(out.prompt_logprobs, reference(llama, prompt, 2))


def test_a_request_asking_reads_no_prefix_cache_hit(llama):
    prefix = prompts_of([16])[0]
    prompt = prefix + [7, 8, 9]
    # one 16-token chunk a step: the prefix's 4 blocks are cached before the others are admitted
    gen = Generator(llama, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    params = [SamplingParams(**GREEDY), SamplingParams(prompt_logprobs=1, **GREEDY), SamplingParams(**GREEDY)]
    outs = gen.generate([prefix, prompt, prompt], params, use_tqdm=False)
    assert_prompt_logprobs(outs[1].prompt_logprobs, reference(llama, prompt, 1))
    # the last (not asking) reads the prefix's 4 blocks; the one asking, admitted after them, read none
    assert gen.stats()["prefix_cache_hit_tokens"] == 16


def test_preemption_mid_prompt_neither_duplicates_nor_loses_entries(llama):
    prompt = prompts_of([14])[0]
    gen = Generator(llama, block_size=4, num_blocks=64, max_num_batched_tokens=5)
    gen.add_request(prompt, SamplingParams(prompt_logprobs=2, n=2, temperature=1.0, seed=1, max_tokens=3))
    gen.step()  # the first chunk: positions 0-4 of 14 score tokens 1-5 (None + 5 entries)
    (seq,) = gen.scheduler.running
    assert seq.num_computed == 5 and len(seq.request.prompt_logprobs) == 6
    gen.scheduler.preempt(seq)  # recomputes from token 0: positions already scored are not again
    outs = []
    while gen.has_unfinished():
        outs += gen.step()
    assert gen.stats()["preemptions"] == 1
    assert_prompt_logprobs(outs[0].prompt_logprobs, reference(llama, prompt, 2))


def test_preemption_in_a_full_cache(llama):
    prompts = prompts_of([13, 7, 10, 12], seed=3)
    params = SamplingParams(prompt_logprobs=1, max_tokens=20, temperature=0.0, ignore_eos=True)
    gen = Generator(llama, block_size=2, num_blocks=24, max_num_batched_tokens=6)
    outs = gen.generate(prompts, params, use_tqdm=False)
    assert gen.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(out.prompt_logprobs, reference(llama, prompt, 1))


def test_only_requests_that_ask_pay_and_they_pay_a_chunk(llama, monkeypatch):
    """The head's rows per call: a request not asking runs its sampling row only; one asking runs
    its prompt positions CHUNK_TOKENS rows at a time (never a ``(prompt, V)`` tensor), plus one
    row in the model's call that checks the head against the model's logits."""
    monkeypatch.setattr(prompt_logprobs, "CHUNK_TOKENS", 3)
    rows, forward = [], llama.lm_head.forward

    def counted(hidden):  # every call of the head's forward, through the module or not
        rows.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return forward(hidden)

    monkeypatch.setattr(llama.lm_head, "forward", counted)
    gen = Generator(llama, block_size=4, num_blocks=64)
    gen.generate([prompts_of([9])[0]], SamplingParams(**GREEDY), use_tqdm=False)
    assert rows == [1, 1, 1]  # one sampling row per step
    rows.clear()
    gen.generate([prompts_of([9])[0]], SamplingParams(prompt_logprobs=0, **GREEDY), use_tqdm=False)
    assert rows == [2, 3, 3, 2, 1, 1]  # first step: sampling + check row, then 8 prompt rows in 3s


def test_a_model_whose_logits_the_head_does_not_reproduce_is_refused():
    """A forward that changes the logits after the head (here a hook doubling them) would make the
    chunked head's log-probs wrong: refused, naming why, and the generator is left clean."""
    model = tiny_model("llama")

    def double(module, args, out):
        out.logits.mul_(2)

    model.register_forward_hook(double)
    gen = Generator(model, block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="prompt_logprobs: LlamaForCausalLM's logits differ from its head"):
        gen.generate([prompts_of([6])[0]], SamplingParams(prompt_logprobs=1, **GREEDY), use_tqdm=False)
    assert not gen.has_unfinished() and gen.allocator.num_free == gen.allocator.num_blocks


@pytest.mark.parametrize("value", [-1, -2, 1.5, "3", True])
def test_bad_prompt_logprobs_are_a_clear_error(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_episodes_refuse_prompt_logprobs(llama):
    with pytest.raises(ValueError, match="prompt_logprobs is for generate"):
        Generator(llama, block_size=4, num_blocks=16).run_episodes(
            [[5, 6]], sampling_params=SamplingParams(prompt_logprobs=1)
        )


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_hybrid_prompt_logprobs_equal_a_full_forward(family):
    """Chunked prefill, and a prompt whose prefix (blocks and state snapshots) an earlier request
    left in the cache: the request asking computes its whole prompt."""
    model = tiny_model(family)
    prompts = prompts_of([13, 1, 6])
    prompts.append(prompts[0] + [5, 6])
    asking = SamplingParams(prompt_logprobs=2, **GREEDY)
    gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=5, max_num_seqs=2)
    outs = gen.generate(prompts, [SamplingParams(**GREEDY)] + [asking] * 3, use_tqdm=False)
    assert outs[0].prompt_logprobs is None
    for prompt, out in zip(prompts[1:], outs[1:]):
        assert_prompt_logprobs(out.prompt_logprobs, reference(model, prompt, 2), atol=1e-4)
    assert gen.stats()["prefix_cache_hit_tokens"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_logprobs_equal_the_trainers_chunked_head_bitwise(dtype):
    """In batch_invariant(): the prompt log-probs equal the trainer's chunked head
    (:func:`nopad.packing.head.chunked.token_logprobs`) on the packed prompts bit for bit, whether the generator
    ran small or large steps (a softcapped head)."""
    model = tiny_model("gemma2").to(dtype)
    prompts = prompts_of([5, 30, 12], seed=4)
    ids = torch.tensor(sum(prompts, []))
    labels, start = ids.clone(), 0
    for prompt in prompts:
        labels[start] = IGNORE_INDEX  # nothing predicts a prompt's first token
        start += len(prompt)
    row = PackedRow.build(ids, labels, VarlenMeta.from_lengths([len(p) for p in prompts]))
    with batch_invariant():
        with use_nopad_attention(model), torch.no_grad():
            trainer, _ = token_logprobs(model, row.model_kwargs(), *row.loss_tokens())
        for budget in (7, 200):
            outs = Generator(model, block_size=16, num_blocks=64, max_num_batched_tokens=budget).generate(
                prompts, SamplingParams(prompt_logprobs=1, **GREEDY), use_tqdm=False
            )
            generator = torch.tensor(
                [entry[token] for p, o in zip(prompts, outs) for token, entry in zip(p[1:], o.prompt_logprobs[1:])]
            )
            assert torch.equal(generator, trainer), budget
