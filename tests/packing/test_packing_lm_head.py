"""The chunked LM head (nopad.packing.head.chunked) equals the full-logits path in fp32 - log-probs, entropies
and gradients - for every head a model may bring, and never builds the row's T x V logits."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from nopad.packing.head import chunked as lm_head
from nopad.packing.head.chunked import nll_sum, token_logprobs
from nopad.packing.head.model_head import LMHead, head_of
from nopad.packing.hf import use_nopad_attention
from nopad.packing.row import IGNORE_INDEX, PackedRow
from nopad.packing.varlen import VarlenMeta
from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs
from tests.support.models import _COMMON, random_sequences, tiny_model


def _row(lengths, prompt=3, seed=0) -> PackedRow:
    ids = torch.cat(random_sequences(lengths, seed=seed))
    labels, start = ids.clone(), 0
    for n in lengths:
        labels[start : start + min(prompt, n)] = IGNORE_INDEX  # each sequence's first token has no loss
        start += n
    return PackedRow.build(ids, labels, VarlenMeta.from_lengths(lengths))


def _granite():
    config = transformers.GraniteConfig(**_COMMON, logits_scaling=8.0, attention_multiplier=0.25)
    return transformers.GraniteForCausalLM(config).float().eval()


def _cohere():
    config = transformers.CohereConfig(**_COMMON, logit_scale=0.25)
    return transformers.CohereForCausalLM(config).float().eval()


def _biased():
    model = tiny_model("llama")
    model.lm_head = torch.nn.Linear(64, 128, bias=True)
    torch.nn.init.normal_(model.lm_head.bias)
    return model


def _lora():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_model("llama"), config)
    assert "lora" in type(head_of(model).module).__module__
    return model


MODELS = {
    "llama": lambda: tiny_model("llama"),
    "tied": lambda: tiny_model("llama", tie_word_embeddings=True),
    "bias": _biased,
    "gemma2-softcap": lambda: tiny_model("gemma2"),
    "granite-divide": _granite,
    "cohere-multiply": _cohere,
    "lora-on-lm_head": _lora,
}


def _full_logits(model, row, temperature):
    """The reference: every position's logits, then log_softmax at the loss positions."""
    logits = model(**row.model_kwargs(), use_cache=False).logits[0].float()
    predict_at, targets = row.loss_tokens()
    logp = torch.log_softmax(logits[predict_at] / temperature, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _value_and_grads(model, fn):
    model.zero_grad()
    logps, ents = fn()
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(logps.shape, generator=g), torch.randn(ents.shape, generator=g)
    ((logps * w1).sum() + (ents * w2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), ents.detach(), grads


def _assert_same(ours, ref):
    (lp, ent, grads), (lp_ref, ent_ref, grads_ref) = ours, ref
    torch.testing.assert_close(lp, lp_ref, rtol=1e-6, atol=1e-6 * float(lp_ref.abs().max()))
    torch.testing.assert_close(ent, ent_ref, rtol=1e-6, atol=1e-6 * float(ent_ref.abs().max()))
    assert grads.keys() == grads_ref.keys() and grads
    for name, g in grads.items():
        scale = float(grads_ref[name].abs().max()) + 1e-12
        assert float((g - grads_ref[name]).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("chunk", [5, lm_head.CHUNK_TOKENS])
def test_equals_the_full_logits_path(name, chunk):
    torch.manual_seed(0)
    model = MODELS[name]()
    row = _row([17, 9, 30, 2])  # 58 tokens, 46 loss tokens: 5 does not divide them
    temperature = 0.7 if chunk == 5 else 1.0
    with use_nopad_attention(model):
        predict_at, targets = row.loss_tokens()
        ours = _value_and_grads(
            model,
            lambda: token_logprobs(
                model,
                row.model_kwargs(),
                predict_at,
                targets,
                temperature=temperature,
                entropy=True,
                chunk_tokens=chunk,
            ),
        )
        ref = _value_and_grads(model, lambda: _full_logits(model, row, temperature))
    _assert_same(ours, ref)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_weighted_nll_equals_the_full_logits_path(name):
    """nll_sum (a plain head's gradients taken in the forward) == the weighted full-logits loss,
    value and every gradient, with a chunk that does not divide the tokens."""
    torch.manual_seed(0)
    model = MODELS[name]()
    row = _row([17, 9, 30, 2])
    predict_at, targets = row.loss_tokens()
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(2))
    with use_nopad_attention(model):
        ours = _value_and_grads(
            model,
            lambda: (
                nll_sum(model, row.model_kwargs(), predict_at, targets, weights, chunk_tokens=5)[None],
                torch.zeros(1),
            ),
        )
        ref = _value_and_grads(
            model, lambda: (-(weights * _full_logits(model, row, 1.0)[0]).sum()[None], torch.zeros(1))
        )
    _assert_same(ours, ref)


def test_a_row_with_a_single_loss_token_and_one_with_none():
    model = tiny_model("qwen3")
    row = _row([7], prompt=6)
    with use_nopad_attention(model):
        predict_at, targets = row.loss_tokens()
        assert targets.numel() == 1
        ours = _value_and_grads(
            model, lambda: token_logprobs(model, row.model_kwargs(), predict_at, targets, entropy=True)
        )
        _assert_same(ours, _value_and_grads(model, lambda: _full_logits(model, row, 1.0)))
        none = _row([5], prompt=5)
        logps, ents = token_logprobs(model, none.model_kwargs(), *none.loss_tokens(), entropy=True)
        assert logps.shape == ents.shape == (0,)
        model.zero_grad(set_to_none=True)
        logps.sum().backward()  # still a graph: a rank with nothing to learn joins the backward
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing  # the head too (lm_head once got no gradient, which DDP waits for)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_a_temperature_that_is_not_positive_and_finite_is_refused(temperature):
    """A temperature of 0 used to give NaN log-probs and -1 a reversed distribution, silently."""
    model = tiny_model("llama")
    row = _row([9, 5])
    refused = pytest.raises(ValueError, match=r"^temperature must be a finite number > 0")
    with use_nopad_attention(model), refused:
        token_logprobs(model, row.model_kwargs(), *row.loss_tokens(), temperature=temperature)


def test_tree_rows_score_each_loss_token_once_and_each_pair_alike():
    """A GRPO group as a prefix-tree row: the shared completion start is one token, read by two pairs."""
    model = tiny_model("llama")
    prompt = random_sequences([12], seed=3)[0].tolist()
    rollouts = [Rollout(prompt, [5, 6, 7, 8]), Rollout(prompt, [5, 6, 9]), Rollout(prompt, [10])]
    (row,) = pack_rollouts(rollouts, 64)
    assert row.pair_tokens is not None and row.num_loss_tokens == 8 > row.loss_tokens()[1].numel()
    with use_nopad_attention(model):
        ours = _value_and_grads(model, lambda: packed_logprobs(model, row, 0.9, compute_entropy=True))

        def reference():
            lp, ent = _full_logits(model, row, 0.9)
            return row.per_pair(lp), row.per_pair(ent)

        _assert_same(ours, _value_and_grads(model, reference))


def test_a_model_that_changes_its_logits_in_an_unknown_way_falls_back_to_its_logits(monkeypatch, caplog):
    """Never a silent wrong answer: an op after the head that nopad does not read (here the softcap,
    forgotten) is found by the one-row check, logged, and scored from the model's own logits."""
    model = tiny_model("gemma2")
    monkeypatch.setattr(lm_head, "head_of", lambda m: LMHead(m.get_output_embeddings()))  # softcap forgotten
    monkeypatch.setattr(lm_head, "_warned", set())
    row = _row([20, 9])
    with use_nopad_attention(model), caplog.at_level("WARNING", logger="nopad.packing.head.chunked"):
        ours = _value_and_grads(
            model, lambda: token_logprobs(model, row.model_kwargs(), *row.loss_tokens(), temperature=0.8, entropy=True)
        )
        _assert_same(ours, _value_and_grads(model, lambda: _full_logits(model, row, 0.8)))
    assert "transforms the logits" in caplog.text and "full logits" in caplog.text


def test_a_non_finite_row_is_not_refused_by_the_check():
    """NaN hidden states (put in through the final norm) give NaN log-probs, for nopad's own
    non-finite errors to report, not a logits-check error."""
    model = tiny_model("gemma2")
    model.model.norm.register_forward_hook(lambda module, args, out: out * float("nan"))
    row = _row([20])
    with use_nopad_attention(model):
        logps, _ = token_logprobs(model, row.model_kwargs(), *row.loss_tokens())
    assert logps.numel() and bool(logps.isnan().all())


def test_head_of_reads_each_family_once():
    assert head_of(tiny_model("gemma2")).softcap == 30.0
    assert head_of(_granite()).divisor == 8.0
    assert head_of(_cohere()).multiplier == 0.25
    plain = head_of(tiny_model("llama"))
    assert (plain.softcap, plain.multiplier, plain.divisor) == (None, None, None)


class _LargestTensor(TorchDispatchMode):
    """The largest tensor any op makes (forward and backward), by element count."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_row_logits_never_exist_with_a_151936_vocabulary():
    """Tracked allocation, not a timing: the full-logits path makes a T x V tensor, the chunked head
    nothing larger than one chunk's logits, and it saves no V-wide tensor for backward."""
    vocab, tokens, chunk = 151_936, 256, 32
    model = tiny_model(
        "llama",
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    ids = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0] = IGNORE_INDEX
    row = PackedRow.build(ids, labels, VarlenMeta.from_lengths([tokens]))
    predict_at, targets = row.loss_tokens()
    saved, weights = [], {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):  # V-wide activations saved for backward (not the weights, nor views of them)
        activation = t.untyped_storage().data_ptr() not in weights
        saved.append(t.numel() if activation and t.dim() and t.shape[-1] == vocab else 0)
        return t

    with use_nopad_attention(model):
        with _LargestTensor() as full:
            _full_logits(model, row, 1.0)[0].sum().backward()
        with _LargestTensor() as ours, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logps, _ = token_logprobs(model, row.model_kwargs(), predict_at, targets, chunk_tokens=chunk)
        with _LargestTensor() as ours_backward:
            logps.sum().backward()
    assert full.largest >= (tokens - 1) * vocab  # the tracker sees the full path's logits
    assert max(ours.largest, ours_backward.largest) <= chunk * vocab
    assert max(saved) <= vocab  # at most the one row the model's own head computes (the check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_log_softmax_written_over_its_logits_has_the_same_bits(dtype, temperature):
    """The chunked head overwrites each chunk's logits with their log-softmax (one (chunk, V)
    buffer, not two): the same kernel in place, so the same bits as a fresh result; fp32 logits
    are reused, bf16 ones are left alone (their fp32 copy is overwritten)."""
    from nopad.packing.head.log_softmax import tempered_log_softmax

    logits = (torch.randn(5, 40_000, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)
    fresh = tempered_log_softmax(logits, temperature)
    kept = logits.clone()
    overwritten = tempered_log_softmax(logits, temperature, overwrite=True)
    assert overwritten.dtype == torch.float32 and torch.equal(overwritten, fresh)
    assert (overwritten.data_ptr() == logits.data_ptr()) == (dtype == torch.float32)
    if dtype == torch.bfloat16:
        assert torch.equal(logits, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generator_logprobs_equal_the_chunked_heads_bitwise_whatever_the_token_count(dtype, monkeypatch, one_thread):
    """In batch_invariant(): the generator's raw and tempered log-probs equal the trainer's through the
    chunked head bit for bit, whether the generator ran big or small steps and whatever the rows'
    token counts and the chunk size (a softcapped head)."""
    from nopad.inference import Generator, SamplingParams
    from nopad.packing.invariance import batch_invariant

    model = tiny_model("gemma2").to(dtype)
    prompts = [p.tolist() for p in random_sequences([5, 30, 12, 50], seed=4)]
    for budget, temperature in ((13, 1.0), (200, 0.7)):
        params = SamplingParams(temperature=temperature, n=2, max_tokens=8, seed=3)
        with batch_invariant():
            outs = Generator(model, max_num_batched_tokens=budget, num_blocks=64, block_size=16).generate(
                prompts, params, use_tqdm=False
            )
            rollouts = [
                Rollout(p, list(c.token_ids), list(c.temperature_logprobs))
                for p, o in zip(prompts, outs)
                for c in o.outputs
                if c.token_ids
            ]
            for capacity, chunk in ((64, 1), (150, 7), (1000, 128)):
                monkeypatch.setattr(lm_head, "CHUNK_TOKENS", chunk)
                with use_nopad_attention(model), torch.no_grad():
                    rows = pack_rollouts(rollouts, capacity)
                    trainer = torch.cat([packed_logprobs(model, row, temperature) for row in rows])
                generator = torch.cat([row.token_values["gen_logprobs"] for row in rows])
                assert trainer.numel() == generator.numel() > 0
                assert torch.equal(trainer, generator), (budget, capacity, chunk)


def test_a_forward_in_batch_invariant_mode_backpropagates_outside_it():
    """GRPO runs only the forward in the mode; each chunk's recompute replays the forward's numerics."""
    from nopad.packing.invariance import batch_invariant

    model = tiny_model("llama")
    row = _row([20, 9])
    with use_nopad_attention(model):
        with batch_invariant():
            logps, _ = token_logprobs(model, row.model_kwargs(), *row.loss_tokens(), chunk_tokens=4)
        logps.sum().backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters())


def _fp32_gradients(lm: LMHead, hidden, targets, weights):
    """The weighted NLL's gradients as the head takes them on a CPU without bf16 GEMMs: the module's
    bf16 output and final-logit ops (their backward in bf16, by autograd), the log-softmax and its
    gradient in fp32, then the GEMMs in fp32."""
    out = lm.module(hidden).detach().requires_grad_()
    z = lm.finish(out)
    zf = z.detach().float().requires_grad_()
    (-(weights * torch.log_softmax(zf, -1).gather(1, targets[:, None])[:, 0]).sum()).backward()
    g = torch.autograd.grad(z, out, zf.grad.to(z.dtype))[0].float() if lm.final_ops else zf.grad
    weight = lm.module.weight.detach().float()
    return g @ weight, g.t() @ hidden.float(), g.sum(0)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_bf16_heads_gradients_are_summed_in_fp32_on_a_cpu_without_bf16_gemms(native, softcap, monkeypatch):
    """bf16 on a CPU without oneDNN's bf16 GEMMs: each chunk's logit gradient stays fp32 and both
    gradient GEMMs run in fp32 (torch's fallback bf16 GEMM is 5-30x slower), so the gradients are
    the fp32 sums rounded once to bf16; with native GEMMs, the bf16 ones, within bf16 rounding. The
    log-probs are the module's bf16 logits' either way (the generator's)."""
    from nopad.packing.head import linear as linear_head
    from nopad.packing.head.chunked import head_logprobs, head_nll_sum

    monkeypatch.setattr(linear_head, "_native_gemm", lambda t: native)
    monkeypatch.setattr(linear_head, "_VOCAB_SLICE_ELEMENTS", 700 * 16)  # slices that do not divide V
    g = torch.Generator().manual_seed(0)
    lm = LMHead(torch.nn.Linear(16, 3000).to(torch.bfloat16), softcap=softcap)
    with torch.no_grad():
        lm.module.weight.copy_(torch.randn(lm.module.weight.shape, generator=g))
        lm.module.bias.copy_(torch.randn(lm.module.bias.shape, generator=g))
    hidden = torch.randn(37, 16, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 3000, (37,), generator=g)
    weights = torch.rand(37, generator=g)
    with torch.no_grad():
        logps = head_logprobs(lm, hidden, targets, chunk_tokens=5, hooks=False)[0]
    ref = _fp32_gradients(lm, hidden, targets, weights)

    def loss_and_grads(fn):
        lm.module.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_()
        loss = fn(h)
        loss.backward()
        return loss.detach(), (h.grad, lm.module.weight.grad, lm.module.bias.grad)

    for loss, grads in (
        loss_and_grads(lambda h: head_nll_sum(lm, h, targets, weights, chunk_tokens=5, hooks=False)),
        loss_and_grads(lambda h: -(weights * head_logprobs(lm, h, targets, chunk_tokens=5, hooks=False)[0]).sum()),
    ):
        assert torch.equal(loss, -(weights * logps).sum())
        for ours, theirs in zip(grads, ref):
            assert ours.dtype == torch.bfloat16
            err, scale = (ours.float() - theirs).abs(), float(theirs.abs().max())
            assert float(err.max()) <= 2**-7 * scale  # bf16 rounding, either way
            if not native:  # fp32 sums rounded once to bf16: within one step
                assert bool((err <= 2**-8 * theirs.abs() + 1e-6 * scale).all())
