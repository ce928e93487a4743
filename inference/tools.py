"""Tool calls of an episode: how they are read from a model turn and written back as tokens
(:class:`ChatTemplateTools`, the chat template's own format), and how they run off the decode
loop (:class:`ToolRunner`: a thread pool, an asyncio loop for ``async def`` tools, a timeout).

A tool that raises (``sys.exit`` included), times out, returns a non-string, a string longer than
the limit or text the tokenizer cannot encode gives an error message as its result, never an
exception in the generator: the model reads the error in the conversation, as in TRL's tool loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from nopad.inference.chat import render

# chat templates with tool calls that nopad ships (inference/templates), by name
TOOL_TEMPLATES = {"smollm2": Path(__file__).parent / "templates" / "smollm2_tools.jinja"}
# transformers' response template (``tokenizer.parse_response``) for their call format,
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, in a ChatML assistant turn
TOOL_CALL_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@dataclass
class ToolCall:
    """One call the model made, and what came back (``error`` True when the result is an
    error message: unknown tool, bad arguments, raised, timed out, garbage output)."""

    name: str
    arguments: dict = field(default_factory=dict)
    result: str | None = None
    error: bool = False


class ToolFormat(Protocol):
    """How tool calls look in token space. ``parse`` returns the calls of a finished model turn
    (empty: a final answer) or raises ValueError for a malformed call (the model's fault, kept in
    ``Turn.malformed``; any other exception is taken as a bug in ``parse``); ``render`` returns the
    tokens of the tool messages ``[{"role": "tool", "name": ..., "content": ...}]`` that follow
    the turn ``turn_ids``. ``prompt_ids`` (optional) renders a conversation's first prompt."""

    def parse(self, turn_ids: list[int], prefix_ids: list[int]) -> list[ToolCall]: ...

    def render(self, messages: list[dict], turn_ids: list[int]) -> list[int]: ...


class ChatTemplateTools:
    """The tokenizer's chat template as the tool format: calls are parsed by transformers'
    ``tokenizer.parse_response`` (its ``response_template``), results rendered by the template's
    tool-message format. Only the rendered suffix is appended (token-in/token-out): it is the
    difference between the template with and without the tool messages, which is only sound for
    a template that keeps earlier turns as a token prefix, so other templates are refused."""

    def __init__(self, tokenizer, tools: list[Callable] | None = None, **chat_template_kwargs):
        if getattr(tokenizer, "response_template", None) is None:
            raise ValueError(
                "the tokenizer has no response_template, so transformers cannot parse tool calls from its "
                "output. Set one (trl.chat_template_utils.add_response_schema(tokenizer) knows the common "
                "templates) or pass Generator.run_episodes(..., tool_format=) your own ToolFormat"
            )
        self.tokenizer, self.tools = tokenizer, list(tools or [])
        self.kwargs = chat_template_kwargs
        if not self._prefix_preserving():
            raise ValueError(
                "the chat template does not render earlier turns as a token prefix of later ones (checked "
                "with a tool call and a tool message, as TRL's is_chat_template_prefix_preserving does), so "
                "appending only the tool result's tokens would not equal the rendered conversation. Use a "
                "prefix-preserving template (trl.chat_template_utils.get_training_chat_template)"
            )

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return render(self.tokenizer, messages, generation_prompt, tools=self.tools, **self.kwargs)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self._ids(messages, True)

    def _prefix_preserving(self) -> bool:
        head = _one_call_conversation("dummy")
        before = self._ids(head, False)
        after = self._ids(head + [{"role": "tool", "name": "dummy", "content": "dummy"}], True)
        return after[: len(before)] == before

    def parse(self, turn_ids: list[int], prefix_ids: list[int]) -> list[ToolCall]:
        parsed = self.tokenizer.parse_response(turn_ids, prefix=prefix_ids, tools=self.tools or None)
        if not isinstance(parsed, dict):
            raise ValueError(f"parse_response returned {type(parsed).__name__}, not a message")
        calls = []
        for call in parsed.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"tool call without a name: {call!r}")
            arguments = function.get("arguments") or {}
            if not isinstance(arguments, dict):
                raise ValueError(f"tool call {function['name']!r} has arguments {arguments!r}, not an object")
            calls.append(ToolCall(function["name"], arguments))
        return calls

    def render(self, messages: list[dict], turn_ids: list[int]) -> list[int]:
        """The tokens of ``messages`` after a turn that ended with ``turn_ids[-1]``, then the next
        assistant header: rendered after a one-call dummy conversation (the real tool name: some
        templates name the tool in the response header) and cut where that conversation's
        assistant turn ends, at the token the model ended its own turn with."""
        head = _one_call_conversation(messages[0]["name"])
        before = self._ids(head, False)
        full = self._ids(head + messages, True)
        if turn_ids and turn_ids[-1] in before:  # e.g. "<|im_end|>\n": the model stopped at <|im_end|>
            before = before[: len(before) - before[::-1].index(turn_ids[-1])]
        if full[: len(before)] != before:
            raise ValueError("the chat template renders the turn before a tool message differently with it")
        return full[len(before) :]


def use_tool_template(tokenizer, template: str = "smollm2"):
    """Give ``tokenizer`` a chat template that renders tools, tool calls and tool results, and the
    response template that parses the calls back (what :class:`ChatTemplateTools` and TRL's tool
    loop need), for models whose own template has none: SmolLM2's (``"smollm2"``). ``template`` is a
    name in :data:`TOOL_TEMPLATES` or a ``.jinja`` file that writes calls in the same
    ``<tool_call>`` JSON format in ChatML turns. Returns the tokenizer."""
    path = TOOL_TEMPLATES.get(template, Path(template))
    if template not in TOOL_TEMPLATES and not (path.suffix == ".jinja" and path.is_file()):
        raise ValueError(
            f"tool template {template!r} is neither one nopad ships ({sorted(TOOL_TEMPLATES)}) nor a .jinja file"
        )
    chat_template = path.read_text()
    _check_writes_tool_calls(tokenizer, chat_template, template)
    tokenizer.chat_template = chat_template
    tokenizer.response_template = TOOL_CALL_RESPONSE
    return tokenizer


def _check_writes_tool_calls(tokenizer, chat_template: str, template: str) -> None:
    """A ``.jinja`` file that does not parse, or renders no ``<tool_call>``, failed only at the
    first rollout (a jinja traceback) or trained episodes that never call a tool."""
    try:
        text = tokenizer.apply_chat_template(
            _one_call_conversation("probe_tool"), tokenize=False, chat_template=chat_template
        )
    except Exception as err:  # jinja's TemplateSyntaxError / UndefinedError, transformers' errors
        raise ValueError(
            f"tool template {template!r} does not render a tool call: {type(err).__name__}: {err}"
        ) from None
    if "<tool_call>" not in text or "probe_tool" not in text:
        raise ValueError(
            f"tool template {template!r} does not write an assistant's tool calls as "
            '<tool_call>{"name": ..., "arguments": ...}</tool_call> (what nopad parses '
            "back); see inference/templates/ for one that does"
        )


class ToolRunner:
    """Runs tool calls in a thread pool (``async def`` tools on one event-loop thread) so the
    decode loop never waits on them; :meth:`collect` turns each finished or timed-out call
    into its result string."""

    def __init__(self, timeout: float, max_result_chars: int, workers: int = 8):
        self.timeout, self.max_result_chars = timeout, max_result_chars
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nopad-tool")
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, calls: list[ToolCall], tools: dict[str, Callable]) -> tuple[list, float]:
        """Start every call; returns one future (or None when it cannot start) per call and the
        deadline after which unfinished calls count as timed out."""
        futures = []
        for call in calls:
            fn = tools.get(call.name)
            if fn is None:
                _fail(call, f"unknown tool {call.name!r}; the tools are {sorted(tools)}")
                futures.append(None)
            elif inspect.iscoroutinefunction(fn):
                coroutine = _call_async(fn, call.arguments)
                futures.append(asyncio.run_coroutine_threadsafe(coroutine, self._event_loop()))
            else:
                futures.append(self._pool.submit(_call_sync, fn, call.arguments))
        return futures, time.monotonic() + self.timeout

    def collect(self, calls: list[ToolCall], futures: list) -> None:
        """Fill in each call's result from its future (an error message for every fault). Called
        once every future is done or the deadline passed: a call still running then timed out."""
        for call, future in zip(calls, futures):
            if future is None:
                continue
            name = call.name
            if not future.done():
                future.cancel()  # a thread cannot be stopped: it runs on, its result is dropped
                _fail(call, f"tool {name!r} did not return within {self.timeout} s")
                continue
            try:
                value = future.result()
            except ToolExited as err:
                _fail(call, f"tool {name!r} {err}")
                continue
            except Exception as err:  # noqa: BLE001 - any tool failure becomes a message to the model
                _fail(call, f"tool {name!r} raised {type(err).__name__}: {err}")
                continue
            if not isinstance(value, str):
                _fail(call, f"tool {name!r} returned {type(value).__name__}, not a string")
            elif (bad := _not_encodable(value)) is not None:
                _fail(
                    call,
                    f"tool {name!r} returned text that is not valid Unicode (a lone surrogate, "
                    f"{value[bad]!r}, at character {bad}), which no tokenizer can encode",
                )
            elif len(value) > self.max_result_chars:
                _fail(
                    call,
                    f"tool {name!r} returned {len(value)} characters, more than "
                    f"max_tool_result_chars={self.max_result_chars}",
                )
            else:
                call.result = value

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="nopad-tool-loop", daemon=True).start()
        return self._loop

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


def _fail(call: ToolCall, message: str) -> None:
    call.result, call.error = f"error: {message}", True


def _one_call_conversation(name: str) -> list[dict]:
    """A user message and an assistant turn calling ``name``: what a tool message follows."""
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]


class ToolExited(Exception):
    """A tool called ``sys.exit``: that call's error, not the end of the whole rollout."""

    def __init__(self, code):
        super().__init__(
            f"called sys.exit({code!r}); a tool returns its result (an error message is fine) instead of exiting"
        )


def _call_sync(fn, arguments: dict):
    try:
        return fn(**arguments)
    except SystemExit as err:
        raise ToolExited(err.code) from None


async def _call_async(fn, arguments: dict):
    try:
        return await fn(**arguments)
    except SystemExit as err:  # on the loop thread it would also stop the loop for every later call
        raise ToolExited(err.code) from None


def _not_encodable(text: str) -> int | None:
    """The index of the first character UTF-8 cannot encode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def wait_any(futures: list, deadline: float) -> None:
    """Block until one of ``futures`` finishes or ``deadline`` (time.monotonic) passes."""
    live = [f for f in futures if f is not None and not f.done()]
    if live:
        cf.wait(live, timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED)


def wait_all(futures: list, deadline: float) -> None:
    """Block until every one of ``futures`` finished or ``deadline`` (time.monotonic) passes."""
    live = [f for f in futures if f is not None and not f.done()]
    if live:
        cf.wait(live, timeout=max(0.0, deadline - time.monotonic()), return_when=cf.ALL_COMPLETED)


def public_methods(environment) -> dict[str, Callable]:
    """An environment's tools: its public methods other than ``reset`` and ``get_reward`` (TRL's
    contract: ``get_reward()`` is the environment's own reward, never a tool the model may call)."""
    return {
        name: getattr(environment, name)
        for name in dir(environment)
        if not name.startswith("_") and name not in ("reset", "get_reward") and callable(getattr(environment, name))
    }
