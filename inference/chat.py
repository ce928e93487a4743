"""The one way nopad turns a conversation into tokens: the chat template call, the prompt of a
single-turn task, the assistant turns' spans, and the check of chat data.

Why one module: SFT (preprocess and per-turn samples), the GRPO recipe's prompts, tool episodes
and the TRL rollout each used to call ``apply_chat_template`` with their own options, and the
assistant-span algorithm was written twice, so one conversation could tokenize differently for SFT
and for GRPO. Everything here renders through :func:`render`, so it tokenizes the same everywhere.

It lives in ``inference/`` because the generator renders tool turns with it and ``training/`` and
``recipes/`` sit above ``inference/`` (see tests/test_import_graph.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

ROLES = ("system", "developer", "user", "assistant", "tool")  # what chat templates render
CHAT_SETTINGS = (True, False, "auto")


def render(
    tokenizer,
    messages: Sequence[Mapping],
    generation_prompt: bool = False,
    *,
    tools=None,
    chat_template: str | None = None,
    **template_kwargs,
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template (the tokenizer's, or
    ``chat_template``), with the assistant's generation prompt when asked. ``tools`` goes through
    as TRL passes it (``or None``: some templates render tool boilerplate for an empty list)."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("chat data needs a tokenizer with a chat_template")
    ids = tokenizer.apply_chat_template(
        list(messages),
        tools=tools or None,
        chat_template=chat_template,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **template_kwargs,
    )
    if isinstance(ids, Mapping):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def encode_prompt(tokenizer, text: str, chat: bool | str = "auto") -> list[int]:
    """Token ids of one prompt: one user turn and the generation prompt when ``chat`` is true (the
    tokenizer must have a template) or ``"auto"`` and it has one, else the plain text."""
    if chat not in CHAT_SETTINGS:
        raise ValueError(f"model.chat_template must be true, false or auto, got {chat!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is True and not has_template:
        raise ValueError(
            "model.chat_template=true but the tokenizer has no chat template, so prompts would "
            "be raw text the model was not tuned on; set model.chat_template=false to use raw "
            "text on purpose, or auto to use a template only where there is one"
        )
    if chat and has_template:
        return render(tokenizer, [{"role": "user", "content": text}], True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def assistant_turns(tokenizer, messages: Sequence[Mapping]) -> list[tuple[list[int], int]]:
    """``(ids, start)`` for each assistant turn: ``ids`` is the conversation rendered up to and
    including the turn, ``ids[start:]`` the turn's own tokens. The start is found by rendering the
    conversation before the turn with the generation prompt, which must be a prefix of it."""
    turns = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], True)
        upto = render(tokenizer, messages[: i + 1], False)
        if upto[: len(prompt)] != prompt or len(upto) <= len(prompt):
            raise ValueError(
                f"the chat template does not render the conversation before turn {i} (with the generation "
                "prompt) as a prefix of the conversation with it, so the turn's tokens cannot be told "
                "apart; prompt masking needs a prefix-consistent template"
            )
        turns.append((upto, len(prompt)))
    return turns


def tokenize_conversation(tokenizer, messages: Sequence[Mapping]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a whole conversation; labels are ``IGNORE_INDEX`` outside the
    assistant turns (each turn as :func:`assistant_turns` finds it, so per-turn samples agree)."""
    from nopad.packing.row import IGNORE_INDEX  # here: packing imports torch, and --help reads tool tasks

    input_ids = render(tokenizer, messages, False)
    labels = [IGNORE_INDEX] * len(input_ids)
    for i, (upto, start) in enumerate(assistant_turns(tokenizer, messages)):
        if input_ids[: len(upto)] != upto:
            raise ValueError(
                f"the chat template renders assistant turn {i} differently inside the whole "
                "conversation; prompt masking needs a prefix-consistent template"
            )
        labels[start : len(upto)] = input_ids[start : len(upto)]
    return input_ids, labels


def check_conversation(messages, where: str, field: str = "messages") -> None:
    """A conversation is a list of ``{"role", "content"}`` messages with a known role, string
    content, a user (or system) turn before the first assistant turn, no two assistant turns in
    a row, and at least one assistant turn (else SFT would train on nothing). A wrong one is an
    error naming ``where`` (file:line) and the field, before any template sees it."""

    def fail(what: str) -> None:
        raise ValueError(f"{where}: {what}")

    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        fail(f"{field} must be a non-empty list of {{'role': ..., 'content': ...}} messages, got {got}")
    previous = None
    for i, message in enumerate(messages):
        at = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            fail(f"{at} must be an object {{'role': ..., 'content': ...}}, got {type(message).__name__}")
        role = message.get("role")
        if "role" not in message or not isinstance(role, str):
            fail(f"{at}.role is {'missing' if 'role' not in message else repr(role)}; give one of {', '.join(ROLES)}")
        if role not in ROLES:
            fail(f"{at}.role {role!r} is not a chat role; give one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not (role == "assistant" and content is None and message.get("tool_calls")):
            got = (
                "missing"
                if "content" not in message
                else "null"
                if content is None
                else f"{type(content).__name__} {content!r}"[:60]
            )
            fail(f"{at}.content must be a string, got {got}")
        if role == "assistant" and previous is None:
            fail(
                f"{at} is an assistant turn before any user turn; it answers nothing. Start the "
                "conversation with a user (or system) message"
            )
        if role == "assistant" and previous == "assistant":
            fail(
                f"{field}[{i - 1}] and {at} are two assistant turns in a row; merge them, or put the "
                "user (or tool) turn between them"
            )
        if role != "system" and role != "developer":
            previous = role
    if not any(m["role"] == "assistant" for m in messages):
        fail(
            "the conversation has no assistant turn, so none of its tokens would be trained on; drop it "
            "or add the assistant's reply (only assistant turns are trained on)"
        )
