"""A new kind of stateful mixer is one module, for training and generation (issue 55 item 3).

The mixer below - an exponential moving average over time with a per-sequence state, which nopad
knows nothing of - is defined, declared and registered here, in this one file, through the one
seam: a :class:`MixerSupport` whose ``state`` declares the tensor the generator keeps per sequence
(:class:`StateSpec`), and a forward that runs a packed row sequence by sequence from zeros and a
generator step from each sequence's slot (``step_states(kwargs).run``). No nopad module changes:
packed rows then train exactly (forward and backward equal each sequence alone) and the generator's
output - chunked prefill, slots reused, several sequences in a step - equals each sequence run alone
by a plain forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nopad import packing
from nopad.inference import Generator, SamplingParams
from nopad.packing.mixers import (
    GENERATE,
    PACKED,
    LayerState,
    MixerSupport,
    StateSpec,
    register_mixer_support,
    step_states,
    unregister_mixer_support,
)
from nopad.packing.mixers.support import UnsupportedMixerError, check_model
from nopad.packing.varlen import VarlenMeta
from tests.inference.test_inference_generator import prompts_of
from tests.support.models import random_sequences, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread_module")
STATE = "ema"


def ema_scan(
    x: torch.Tensor, decay: torch.Tensor, lengths: list[int], initial: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(T, H)``, sequences of ``lengths`` one after another, each from its ``initial`` row
    ``(N, H)``: every token's average and each sequence's final one (fp32)."""
    outs, finals, start = [], [], 0
    for i, n in enumerate(lengths):
        state = initial[i]
        for t in range(start, start + n):
            state = decay * state + (1 - decay) * x[t].float()
            outs.append(state)
        finals.append(state)
        start += n
    return torch.stack(outs), torch.stack(finals)


class EMAMixer(nn.Module):
    """``s_t = a s_{t-1} + (1 - a) x_t`` per channel, ``a = exp(-exp(A_log))``, projected out. Its
    ``A_log`` is what makes nopad's scan find it (a state-space decay): refused until supported."""

    def __init__(self, hidden: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.linspace(-3.0, 0.0, hidden))
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        decay = torch.exp(-torch.exp(self.A_log))
        meta: VarlenMeta | None = kwargs.get("nopad_meta")
        states = step_states(kwargs)
        x = hidden_states[0]
        if states is not None:  # a generator step: each sequence continues from its slot

            def step(step_meta: VarlenMeta, initial: torch.Tensor):
                return ema_scan(x, decay, list(step_meta.seqlens_q), initial)

            out = states.run(STATE, step)
        elif meta is not None:  # a packed row: each sequence from zeros
            if meta.key_rows is not None or meta.seqlens_q is None:
                raise ValueError("EMAMixer serves packed rows and generator steps only")
            out, _ = ema_scan(x, decay, list(meta.seqlens_q), x.new_zeros(len(meta.seqlens_q), x.shape[-1]).float())
        else:  # a plain batch: every row is one sequence
            rows = [ema_scan(r, decay, [r.shape[0]], r.new_zeros(1, r.shape[-1]).float())[0] for r in hidden_states]
            return self.out(torch.stack(rows).to(hidden_states.dtype))
        return self.out(out.to(hidden_states.dtype))[None]


class WithEMA(nn.Module):
    """A decoder layer's attention plus the EMA mixer beside it (both get the layer's kwargs)."""

    def __init__(self, attention: nn.Module, hidden: int):
        super().__init__()
        self.attention, self.ema = attention, EMAMixer(hidden)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        out, weights = self.attention(hidden_states, *args, **kwargs)
        return out + self.ema(hidden_states, **kwargs), weights


def ema_state(module: nn.Module, path: str) -> LayerState | None:
    """The declared per-sequence state: one fp32 average per channel."""
    if not isinstance(module, EMAMixer):
        return None
    return LayerState(path, (StateSpec(STATE, (module.A_log.shape[0],), torch.float32),))


EMA_SUPPORT = MixerSupport(
    "test: exponential moving average",
    lambda m: isinstance(m, EMAMixer),
    frozenset({PACKED, GENERATE}),
    state=ema_state,
)


@pytest.fixture
def ema_model():
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn = WithEMA(layer.self_attn, model.config.hidden_size)
    with torch.no_grad():
        for layer in model.model.layers:  # large enough that a state lost or leaked moves the tokens
            layer.self_attn.ema.out.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    register_mixer_support(EMA_SUPPORT)
    yield model
    unregister_mixer_support(EMA_SUPPORT.name)


def plain_greedy(model: nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The sequence alone, a full forward per token (no nopad, no cache): tokens and log-probs."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            lp = torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0, -1].float(), -1)
            ids.append(int(lp.argmax()))
            logprobs.append(float(lp[ids[-1]]))
    return ids[len(prompt) :], logprobs


def test_refused_until_its_one_module_registers_it(ema_model):
    unregister_mixer_support(EMA_SUPPORT.name)
    with pytest.raises(UnsupportedMixerError, match="EMAMixer|WithEMA"):
        check_model(ema_model, GENERATE)
    register_mixer_support(EMA_SUPPORT)
    check_model(ema_model, GENERATE)


def test_packed_rows_train_exactly(ema_model):
    assert packing.verify(ema_model, random_sequences((3, 8, 5))).ok()


def test_generator_equals_each_sequence_alone(ema_model):
    prompts = prompts_of([1, 5, 13, 3, 9], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # three slots for five prompts (reused: a new sequence starts from zero), prefill in chunks
    gen = Generator(ema_model, block_size=4, num_blocks=64, max_num_batched_tokens=6, max_num_seqs=3)
    outs = gen.generate(prompts, params, use_tqdm=False)
    assert [s.path for s in gen.layer_states] == [f"model.layers.{i}.self_attn.ema" for i in range(2)]
    assert list(gen._kv_cache.states.named) == [STATE]
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = plain_greedy(ema_model, prompt, 6)
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
