"""Offline tool tasks for the GRPO recipe: multi-turn episodes whose reward a program checks.

``calculator``: arithmetic with three operands, and a ``calculator`` tool the model may call in
any turn. The tool call is text the model writes, ``<calc>17 * 23</calc>``: the closing tag is a
stop string that ends the model's turn, the result comes back as ``<result>391</result>`` tokens
appended after it (token-in/token-out, :class:`TextToolFormat`), and the model goes on. This
works with any tokenizer, also for models whose chat template has no tool-call format
(SmolLM2-135M, the tiny test models); a model whose template has one is better served by
:class:`inference.tools.ChatTemplateTools`, which ``Generator.run_episodes`` uses by default.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from inference.tools import ToolCall

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
CALCULATOR_TEMPLATE = ("What is {expression}? A calculator answers {open}EXPR{close} with "
                       "{ropen}N{rclose}. End with the number.")

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
    from the tool, checked by :func:`recipes.tasks.last_number_match`."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    examples = []
    for _ in range(num_prompts):
        a, b, c = (rng.randint(2, max_operand) for _ in range(3))
        expression = f"{a} {rng.choice('+-*')} {b} {rng.choice('+-*')} {c}"
        examples.append({"prompt": CALCULATOR_TEMPLATE.format(expression=expression, open=CALL_OPEN,
                                                             close=CALL_CLOSE, ropen=RESULT_OPEN,
                                                             rclose=RESULT_CLOSE),
                         "answer": calculator(expression)})
    return examples


class TextToolFormat:
    """Tool calls as text (``<calc>EXPR</calc>`` ends a turn, a stop string) and results as the
    tokens of ``<result>VALUE</result>``: an :class:`inference.tools.ToolFormat` for one tool."""

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
