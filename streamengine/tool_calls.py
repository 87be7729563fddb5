"""Tool calls in a model's output: a parser per format, whole-text and streaming.

A parser splits what the model wrote into content (text for the user) and tool calls. Each
format has a whole-text `parse` and a streaming form (`stream()`) that is fed the output piece
by piece: it passes content on as it comes, holds back text that may be the start of a call,
and yields each call as a `ToolCallDelta` once the call is complete (a call is not streamed
token by token). Whatever the split of the output into pieces, the streamed content and calls
add up to what `parse` gives for the whole text.

Formats (`TOOL_PARSERS`):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text
  around them is content; a block whose JSON is not a call stays content. The last block may
  lack its closing tag (a model that stops right after the JSON).
- "llama3_json": the output is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`; text after the calls is content, and an
  output that does not start with a call is all content.

Call ids are `call_` + random hex; arguments are a JSON string, as OpenAI sends them.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: new_call_id())


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What a stream adds to call number `index` of its message (OpenAI's `delta.tool_calls`)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of output adds: content text and completed calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_from_json(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from a decoded `{"name": str, <arguments_key>: object}`; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models send the arguments already as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class StreamingToolParser(ABC):
    """Fed a sample's output piece by piece; `feed` and `finish` return what can be sent."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """Everything still held back, at the end of the output."""

    def _delta(self, call: ToolCall) -> ToolCallDelta:
        self.num_calls += 1
        return ToolCallDelta(self.num_calls - 1, call.id, call.name, call.arguments)


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None when there is none) and the calls of a whole output."""

    @abstractmethod
    def stream(self) -> StreamingToolParser: ...


# ---- hermes -------------------------------------------------------------------------------------

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def _hermes_block(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class _HermesStream(StreamingToolParser):
    """Content goes out as it comes, except a possible `<tool_call>` start and whitespace
    (content is stripped, as `parse` strips it); a call goes out when its block closes."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # unsent text: a possible opening tag, or an open block
        self._space = ""  # whitespace held until more content follows it
        self._started = False  # any content sent yet (leading whitespace is dropped)
        self._in_call = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consumes what the buffer settles; False when the rest must wait for more text."""
        if self._in_call:
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(HERMES_CLOSE):]
            self._in_call = False
            self._emit_block(body, out, closed=True)
            return True
        start = self._buffer.find(HERMES_OPEN)
        if start >= 0:
            self._content(self._buffer[:start], out)
            self._buffer = self._buffer[start + len(HERMES_OPEN):]
            self._in_call = True
            return True
        held = _held_prefix(self._buffer, HERMES_OPEN)
        self._content(self._buffer[: len(self._buffer) - held], out)
        self._buffer = self._buffer[len(self._buffer) - held:]
        return False

    def _emit_block(self, body: str, out: ParsedDelta, *, closed: bool) -> None:
        call = _hermes_block(body)
        if call is not None:
            out.calls.append(self._delta(call))
        else:  # not a call: the block is content, tags and all
            self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""), out)

    def _content(self, text: str, out: ParsedDelta) -> None:
        stripped = text.rstrip()
        if stripped:
            lead = self._space if self._started else ""
            out.content += lead + (stripped if self._started else stripped.lstrip())
            self._started, self._space = True, text[len(stripped):]
        else:
            self._space += text

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:
            self._emit_block(self._buffer, out, closed=False)
        else:
            self._content(self._buffer, out)
        self._buffer, self._in_call = "", False
        return out


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        parts: list[str] = []
        calls: list[ToolCall] = []
        rest = text
        while (start := rest.find(HERMES_OPEN)) >= 0:
            parts.append(rest[:start])
            rest = rest[start + len(HERMES_OPEN):]
            end = rest.find(HERMES_CLOSE)
            body = rest if end < 0 else rest[:end]
            call = _hermes_block(body)
            if call is not None:
                calls.append(call)
            else:
                parts.append(HERMES_OPEN + body + ("" if end < 0 else HERMES_CLOSE))
            rest = "" if end < 0 else rest[end + len(HERMES_CLOSE):]
        parts.append(rest)
        return "".join(parts).strip() or None, calls

    def stream(self) -> StreamingToolParser:
        return _HermesStream()


# ---- llama3_json --------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"[\s;]*")
_DECODER = json.JSONDecoder()


def _llama3_calls(text: str) -> tuple[list[ToolCall], int]:
    """The calls at the start of `text` (after the tag) and where the text after them begins."""
    calls: list[ToolCall] = []
    pos = _SEPARATOR.match(text).end()  # type: ignore[union-attr]
    if text.startswith(PYTHON_TAG, pos):
        pos += len(PYTHON_TAG)
    while True:
        pos = _SEPARATOR.match(text, pos).end()  # type: ignore[union-attr]
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return calls, pos
        # A bare JSON answer such as {"name": "Bob", "age": 3} is content, not a call: the
        # format always carries its arguments.
        key = next((k for k in ("parameters", "arguments") if isinstance(obj, dict) and k in obj), None)
        call = call_from_json(obj, key) if key is not None else None
        if call is None:
            return calls, pos
        calls.append(call)
        pos = end


class _Llama3Stream(StreamingToolParser):
    """An output that may start with a call is held whole; its calls go out as each completes
    and its content at the end. Any other output is content, passed on as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._mode: str | None = None  # "content" or "calls", once the first character says

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        if self._mode == "content":
            return ParsedDelta(text)
        if self._mode is None:
            self._mode = self._decide()
            if self._mode == "content":
                return ParsedDelta(self._text)
        if self._mode == "calls":
            return ParsedDelta("", self._new_calls(_llama3_calls(self._text)[0]))
        return ParsedDelta()

    def _decide(self) -> str | None:
        head = self._text.lstrip()
        if not head:
            return None
        if head.startswith("{") or head.startswith(PYTHON_TAG):
            return "calls"
        return None if PYTHON_TAG.startswith(head) else "content"

    def _new_calls(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        return [self._delta(call) for call in calls[self.num_calls:]]

    def finish(self) -> ParsedDelta:
        if self._mode == "content":
            return ParsedDelta()
        calls, end = _llama3_calls(self._text) if self._mode == "calls" else ([], 0)
        content = self._text[end:].strip() if calls else self._text
        return ParsedDelta(content, self._new_calls(calls))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        head = text.lstrip()
        if not (head.startswith("{") or head.startswith(PYTHON_TAG)):
            return text or None, []
        calls, end = _llama3_calls(text)
        if not calls:
            return text or None, []
        return text[end:].strip() or None, calls

    def stream(self) -> StreamingToolParser:
        return _Llama3Stream()


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
