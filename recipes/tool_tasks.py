"""Offline tool tasks for the GRPO recipe: multi-turn episodes whose reward a program checks.

``calculator_chat``: the same questions, the tool called in the chat template's own format
(``<tool_call>{"name": "calculator", ...}</tool_call>``, parsed by :class:`ChatTemplateTools`), for a
tokenizer with a tool template (``model.tool_template=smollm2``). SmolLM2-135M does not call a
tool unprompted, so :func:`calculator_demonstrations` writes tool-call conversations for a short
warm-start SFT before GRPO (``python -m nopad.recipes.tool_tasks demos.jsonl``, docs/rl.md).

``calculator``: arithmetic with three operands, and a ``calculator`` tool the model may call in
any turn. The tool call is text the model writes, ``<calc>17 * 23</calc>``: the closing tag is a
stop string that ends the model's turn, the result comes back as ``<result>391</result>`` tokens
appended after it (token-in/token-out, :class:`TextToolFormat`), and the model goes on. This
works with any tokenizer, also for models whose chat template has no tool-call format
(SmolLM2-135M, the tiny test models); a model whose template has one is better served by
:class:`nopad.inference.tools.ChatTemplateTools`, which ``Generator.run_episodes`` uses by default.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re

from nopad.inference.tools import ChatTemplateTools, ToolCall
from nopad.recipes.config import ConfigError

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
CALCULATOR_TEMPLATE = (
    "What is {expression}? A calculator answers {open}EXPR{close} with {ropen}N{rclose}. End with the number."
)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE) + r"\s*$", re.DOTALL)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and * (and parentheses).

    Args:
        expression: The expression, e.g. "17 * 23 + 4".
    """

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"the calculator takes integers with + - * and parentheses, not {expression!r}")

    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("the calculator takes one expression string of at most 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from err
    return str(value(tree))


def calculator_task(num_prompts: int = 64, seed: int = 0, max_operand: int = 99) -> list[dict]:
    """``"What is 17 * 23 + 4? ..."`` with answer ``"395"``: large enough that a small model gains
    from the tool, checked by :func:`nopad.recipes.tasks.last_number_match`."""
    tags = {"open": CALL_OPEN, "close": CALL_CLOSE, "ropen": RESULT_OPEN, "rclose": RESULT_CLOSE}
    examples = _expressions(num_prompts, seed, max_operand)
    return [
        {"prompt": CALCULATOR_TEMPLATE.format(expression=ex["expression"], **tags), "answer": ex["answer"]}
        for ex in examples
    ]


def _expressions(num_prompts: int, seed: int, max_operand: int) -> list[dict]:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    examples = []
    for _ in range(num_prompts):
        a, b, c = (rng.randint(2, max_operand) for _ in range(3))
        expression = f"{a} {rng.choice('+-*')} {b} {rng.choice('+-*')} {c}"
        examples.append({"expression": expression, "answer": calculator(expression)})
    return examples


CALCULATOR_SYSTEM = (
    "You have a calculator. Call it like this:\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "2 * 3 + 4"}}\n</tool_call>\n'
    "It answers with the value. Then reply with the number alone."
)


def calculator_chat_task(num_prompts: int = 64, seed: int = 0, max_operand: int = 99) -> list[dict]:
    """The calculator's questions for the chat-template tool format: ``"What is 17 * 23 + 4?"``
    after :data:`CALCULATOR_SYSTEM` (the task's ``system`` turn), answer ``"395"``."""
    examples = _expressions(num_prompts, seed, max_operand)
    return [{"prompt": f"What is {ex['expression']}?", **ex} for ex in examples]


def calculator_demonstrations(num: int = 64, seed: int = 1) -> list[dict]:
    """Chat rows ``{"messages": [...]}`` of the calculator used well: the question, one call with
    the whole expression, the tool's result, the number. A warm-start SFT on them (per-turn
    samples) teaches the format; the seed differs from the task's (0), so GRPO's prompts are new."""
    rows = []
    for ex in calculator_chat_task(num, seed):
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": ex["expression"]}}}
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": CALCULATOR_SYSTEM},
                    {"role": "user", "content": ex["prompt"]},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "calculator", "content": calculator(ex["expression"])},
                    {"role": "assistant", "content": ex["answer"]},
                ]
            }
        )
    return rows


def chat_tool_prompt(tokenizer, system: str, text: str, task: str) -> list[int]:
    """A chat-format tool task's prompt: the system turn and the question, rendered by a chat
    template that writes tool calls (``model.tool_template``)."""
    if getattr(tokenizer, "response_template", None) is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "model.tool_template",
            f"task.name={task} calls its tool in the chat template's "
            "format, and this tokenizer's template has none; set model.tool_template=smollm2 "
            "(SmolLM2 and other ChatML models) or task.name=calculator (calls as plain text)",
        )
    return ChatTemplateTools(tokenizer).prompt_ids(
        [{"role": "system", "content": system}, {"role": "user", "content": text}]
    )


class TextToolFormat:
    """Tool calls as text (``<calc>EXPR</calc>`` ends a turn, a stop string) and results as the
    tokens of ``<result>VALUE</result>``: an :class:`nopad.inference.tools.ToolFormat` for one tool."""

    def __init__(self, tokenizer, tool: str = "calculator", argument: str = "expression"):
        self.tokenizer, self.tool, self.argument = tokenizer, tool, argument

    def parse(self, turn_ids: list[int], prefix_ids: list[int]) -> list[ToolCall]:
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        if not text.rstrip().endswith(CALL_CLOSE):
            return []  # a final answer
        found = _CALL.search(text)
        if found is None:
            raise ValueError(f"{CALL_CLOSE} without {CALL_OPEN}")
        return [ToolCall(self.tool, {self.argument: found.group(1).strip()})]

    def render(self, messages: list[dict], turn_ids: list[int]) -> list[int]:
        text = "".join(f"{RESULT_OPEN}{m['content']}{RESULT_CLOSE}\n" for m in messages)
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def main(argv: list[str] | None = None) -> None:
    """Write :func:`calculator_demonstrations` as JSONL: the warm-start SFT's ``data.source``."""
    parser = argparse.ArgumentParser(prog="python -m nopad.recipes.tool_tasks", description=main.__doc__)
    parser.add_argument("output", help="the JSONL file to write, e.g. runs/calculator_demos.jsonl")
    parser.add_argument("--num", type=int, default=64, help="conversations (default 64)")
    parser.add_argument("--seed", type=int, default=1, help="their questions' seed (the GRPO task's is 0)")
    args = parser.parse_args(argv)
    if args.num < 1:
        parser.error(f"--num must be >= 1, got {args.num}")
    with open(args.output, "w") as f:
        for row in calculator_demonstrations(args.num, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.num} calculator demonstrations to {args.output}")


if __name__ == "__main__":
    main()
