"""Tool episodes on the model nopad ships: SmolLM2's chat template has no tools, so nopad
ships one (``model.tool_template=smollm2``, :func:`nopad.inference.tools.use_tool_template`), and the
``calculator_chat`` task writes its own warm-start demonstrations for a short SFT before GRPO.
A tiny random model with SmolLM2's vocabulary stands in for the weights."""

from __future__ import annotations

import json

import pytest
import torch

from nopad.assets.smollm2 import load_smollm2_tokenizer
from nopad.inference.tools import ChatTemplateTools, use_tool_template
from nopad.recipes.tool_tasks import CALCULATOR_SYSTEM, calculator, calculator_demonstrations, main
from tests.support.models import tiny_model

trl_utils = pytest.importorskip("trl.chat_template_utils")


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


@pytest.fixture(scope="module")
def plain():
    return load_smollm2_tokenizer()


@pytest.fixture(scope="module")
def tok():
    return use_tool_template(load_smollm2_tokenizer())


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_chat_without_tools_renders_as_smollm2s_own_template(plain, tok):
    for chat in (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
    ):
        for prompt in (True, False):
            assert tok.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt
            ) == plain.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)


def test_the_template_renders_tools_calls_and_results(tok):
    chat = [
        {"role": "user", "content": "What is 17 + 25?"},
        {"role": "assistant", "content": "", "tool_calls": [call("add", a=17, b=25)]},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    text = tok.apply_chat_template(chat, tools=[add], tokenize=False)
    assert '"name": "add", "description": "Add two integers."' in text  # the schema, in the system turn
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>\n'
    ) in text
    assert ("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n42") in text
    # TRL's own checks, which its GRPOTrainer(tools=...) and our error message rely on
    assert trl_utils.supports_tool_calling(tok)
    assert trl_utils.is_chat_template_prefix_preserving(tok)
    assert not trl_utils.supports_tool_calling(load_smollm2_tokenizer())  # what the template fixes


def test_tool_calls_round_trip_through_the_parser(tok):
    fmt = ChatTemplateTools(tok, [add])  # refuses a template without tools or prefix preservation
    prompt = fmt.prompt_ids([{"role": "user", "content": "What is 2 + 3 and 4 + 5?"}])
    calls = [call("add", a=2, b=3), call("add", a=4, b=5)]
    full = tok.apply_chat_template(
        [
            {"role": "user", "content": "What is 2 + 3 and 4 + 5?"},
            {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
        ],
        tools=[add],
        tokenize=True,
        return_dict=False,
    )
    assert full[: len(prompt)] == prompt
    turn = full[len(prompt) :]
    parsed = fmt.parse(turn, prompt)
    assert [(c.name, c.arguments) for c in parsed] == [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]
    results = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "9"}]
    appended = fmt.render(results, turn)
    assert tok.decode(appended) == (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n9\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # a final answer has no calls
    answer = tok.encode("The sums are 5 and 9.<|im_end|>")
    assert fmt.parse(answer, prompt) == []


def test_an_unknown_tool_template_is_refused(plain):
    with pytest.raises(ValueError, match="neither one nopad ships"):
        use_tool_template(plain, "qwen9")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{% for m in messages %}{{ m.content }{% endfor %}", r"does not render a tool call: Template"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", r"does not write an assistant's tool calls as "),
    ],
)
def test_a_jinja_file_that_writes_no_tool_calls_is_refused_and_leaves_the_tokenizer_alone(
    plain, tmp_path, text, message
):
    """A broken file used to fail at the first rollout, and one without tool calls was accepted."""
    path = tmp_path / "mine.jinja"
    path.write_text(text)
    before = plain.chat_template
    with pytest.raises(ValueError, match=rf"^tool template '{path}' {message}"):
        use_tool_template(plain, str(path))
    assert plain.chat_template == before


def test_the_warm_start_demonstrations_are_valid(tok, tmp_path):
    from nopad.dataloaders.sources import load_records
    from nopad.training.sft_data import per_turn_samples

    out = tmp_path / "demos.jsonl"
    main([str(out), "--num", "8", "--seed", "3"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == calculator_demonstrations(8, 3) and len(rows) == 8
    fmt = ChatTemplateTools(tok)
    for row in rows:
        system, user, calling, result, answer = row["messages"]
        assert (system["content"], user["role"], result["role"]) == (CALCULATOR_SYSTEM, "user", "tool")
        expression = calling["tool_calls"][0]["function"]["arguments"]["expression"]
        assert user["content"] == f"What is {expression}?"
        assert result["content"] == answer["content"] == calculator(expression)
        # the call the model is taught parses back, as an episode's parser reads it
        prompt = fmt.prompt_ids(row["messages"][:2])
        full = tok.apply_chat_template(row["messages"][:3], tokenize=True, return_dict=False)
        parsed = fmt.parse(full[len(prompt) :], prompt)
        assert [(c.name, c.arguments) for c in parsed] == [("calculator", {"expression": expression})]
    # the SFT recipe's data path (data.source=demos.jsonl data.per_turn_samples=true): two turns each
    samples = per_turn_samples(load_records(str(out), [{"messages": list}], key="data.source"), tok)
    assert len(samples) == 16
    trained = [tok.decode([t for t, m in zip(s.ids, s.loss_mask) if m]) for s in samples[:2]]
    expression = rows[0]["messages"][1]["content"][len("What is ") : -1]
    assert trained == [
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        "\n</tool_call><|im_end|>\n",
        f"{calculator(expression)}<|im_end|>\n",
    ]


def test_the_docs_episode_example_runs_on_smollm2s_tokenizer(tok, one_thread):
    from nopad.inference import EpisodeLimits, Generator, SamplingParams

    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=4096)
    episodes = Generator(model, tok, block_size=16, num_blocks=64).run_episodes(
        [[{"role": "user", "content": "What is 17 + 25? Use the add tool."}]],
        tools=[add],
        sampling_params=SamplingParams(temperature=1.0, n=2, max_tokens=16, seed=0),
        limits=EpisodeLimits(max_turns=2, max_tokens=64, tool_timeout=10.0),
        reward_fn=lambda ep: float("42" in tok.decode(ep.completion_ids)),
    )
    assert len(episodes) == 2
    for ep in episodes:
        assert len(ep.completion_ids) == len(ep.model_mask) and ep.reward in (0.0, 1.0)


def test_the_recipes_chat_calculator_needs_a_tool_template(plain, tok, tmp_path, one_thread):
    from nopad.recipes.config import ConfigError, load_config
    from nopad.recipes.grpo import run_grpo
    from nopad.recipes.grpo_config import GRPORecipeConfig

    cfg = load_config(
        GRPORecipeConfig,
        overrides=[
            "task.name=calculator_chat",
            "task.num_prompts=2",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=2",
            "rollout.max_tokens=24",
            "rollout.max_prompt_tokens=128",
            "rollout.max_turns=2",
            "train.steps=1",
            "generator.num_blocks=64",
            "generator.max_num_batched_tokens=256",
        ],
    )
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=4096)
    with pytest.raises(ConfigError, match="model.tool_template=smollm2"):
        run_grpo(cfg, model=model, tokenizer=plain, progress=False)
    torch.manual_seed(0)
    (metrics,) = run_grpo(cfg, model=model, tokenizer=tok, progress=False)
    assert "tool_calls_per_episode" in metrics and metrics["reward_mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_model_tool_template_is_set_on_load_and_refused_where_it_cannot_be(plain):
    from nopad.recipes.config import ConfigError
    from nopad.recipes.models import _with_tool_template
    from nopad.recipes.tiny_model import AsciiTokenizer

    tok = _with_tool_template(load_smollm2_tokenizer(), "smollm2")
    assert trl_utils.supports_tool_calling(tok) and tok.response_template is not None
    with pytest.raises(ConfigError, match=r"^model.tool_template needs a tokenizer with chat templates"):
        _with_tool_template(AsciiTokenizer(), "smollm2")
    with pytest.raises(ConfigError, match=r"^model.tool_template cannot be used: tool template 'qwen9'"):
        _with_tool_template(plain, "qwen9")
