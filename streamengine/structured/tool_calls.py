"""Tool calls in a model's output: a parser per format, streaming and whole-text.

A parser splits what the model wrote into content (text for the user) and tool calls. Its
streaming form (`stream()`) is fed the output piece by piece and sends each call as OpenAI
streams one: a first `ToolCallDelta` with the call's id and name (arguments ""), once the name
is written, then the arguments' text as it is written. The arguments are the model's own text
of the arguments value (tool_call_reader.py), never re-serialized; content goes on as it comes
and only text that may start a call is held back. `parse` runs the same stream over the whole
output, so whatever the split into pieces, the stream adds up to the parse.

A call begins once its name is known (for llama3_json: its name and the start of its
parameters) and then stays a call, however its text ends: arguments cut by the end of the
output are partial (`CallsEnding.all_complete` false); a closing tag or brace the output lacks
does not matter once the arguments are complete. Text that never became a call is content.

Formats (`TOOL_PARSERS`):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text
  around them is content; a block that does not become a call stays content, tags and all.
  A call whose object closes without arguments has arguments "{}". `HermesParser(forced=True)`
  reads an output constrained to calls (a forced tool choice): it has no content, and a block
  cut before its name is dropped rather than shown as markup.
- "llama3_json": the output is `{"name": ..., "parameters": {...}}` ("arguments" is taken too),
  optionally after `<|python_tag|>`, several separated by `;`; text after the calls is content,
  and an output that does not start with a call is all content, as written.

Call ids are `call_` + random hex; arguments are JSON text, as OpenAI sends them.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from streamengine.structured.tool_call_reader import CallReader, ReaderState


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments, as the model wrote it (partial if it was cut)
    id: str = field(default_factory=lambda: new_call_id())


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What a stream adds to call number `index` of its message (OpenAI's `delta.tool_calls`):
    the first has the call's id and name, the later ones only arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of output adds: content text, and the calls' deltas in order (arguments
    text for one call comes in one delta per piece)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add_arguments(self, index: int, text: str) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index and last.id is None:
            self.calls[-1] = dataclasses.replace(last, arguments=last.arguments + text)
        elif text:
            self.calls.append(ToolCallDelta(index, text))

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        for delta in other.calls:
            if delta.id is None:
                self.add_arguments(delta.index, delta.arguments)
            else:
                self.calls.append(delta)
        return self


@dataclass(frozen=True, slots=True)
class CallsEnding:
    """How an output's calls ended, which its finish reason depends on."""

    num_calls: int = 0
    all_complete: bool = True  # every call's arguments were written to their end
    in_call: bool = False  # the output ended inside a call, before its closing tag or brace


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    calls: list[ToolCall]
    ending: CallsEnding


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _TrimmedText:
    """Text passed on as it comes, less its leading and trailing whitespace: whitespace is
    held until text follows it."""

    __slots__ = ("_space", "_started")

    def __init__(self) -> None:
        self._space = ""
        self._started = False

    def add(self, text: str) -> str:
        stripped = text.rstrip()
        if not stripped:
            self._space += text
            return ""
        out = self._space + stripped if self._started else stripped.lstrip()
        self._started, self._space = True, text[len(stripped):]
        return out


class _CallStream:
    """One call object being read, sent as deltas of call `index` once it is a call."""

    def __init__(self, index: int, argument_keys: tuple[str, ...], *, needs_arguments: bool) -> None:
        self.reader = CallReader(argument_keys)
        self.index = index
        self.started = False  # its first delta (id and name) is sent: it is a call
        self._needs_arguments = needs_arguments  # it is a call only once its arguments begin

    def feed(self, text: str, out: ParsedDelta) -> int:
        """Reads `text` and sends what it adds; returns how much of `text` the object took."""
        used = self.reader.feed(text)
        reader = self.reader
        if not self.started and reader.name is not None and (reader.has_arguments or not self._needs_arguments):
            self.started = True
            out.calls.append(ToolCallDelta(self.index, "", new_call_id(), reader.name))
        if self.started:
            self._send(reader.take_arguments(), out)
        return used

    @property
    def ended(self) -> bool:
        return self.reader.state is not ReaderState.READING

    def end(self, out: ParsedDelta, *, empty_arguments: str = "") -> bool:
        """Sends what the object still held at its end (or the output's); returns whether the
        call's arguments are complete. `empty_arguments`: the arguments of an object that
        closed without any."""
        reader = self.reader
        self._send(reader.take_arguments(final=True), out)
        if reader.state is ReaderState.CLOSED and not reader.has_arguments and empty_arguments:
            self._send(empty_arguments, out)
            return True
        return reader.arguments_done

    def _send(self, text: str, out: ParsedDelta) -> None:
        if text:
            out.add_arguments(self.index, text)


class StreamingToolParser(ABC):
    """Fed a sample's output piece by piece; `feed` and `finish` return what can be sent."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._all_complete = True
        self._in_call = False

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """Everything still held back, at the end of the output."""

    def ending(self) -> CallsEnding:
        return CallsEnding(self.num_calls, self._all_complete, self._in_call)

    def _new_call(self, argument_keys: tuple[str, ...], *, needs_arguments: bool) -> _CallStream:
        return _CallStream(self.num_calls, argument_keys, needs_arguments=needs_arguments)

    def _begun(self, call: _CallStream) -> None:
        """Counts a call once its first delta is out."""
        if call.started and call.index == self.num_calls:
            self.num_calls += 1
            self._in_call = True

    def _close(self, call: _CallStream, out: ParsedDelta, *, at_end: bool, empty_arguments: str = "") -> None:
        """A begun call's object ended (`at_end`: the output ended inside it)."""
        self._all_complete &= call.end(out, empty_arguments=empty_arguments)
        self._in_call = at_end


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def stream(self) -> StreamingToolParser: ...

    def parse(self, text: str) -> ParsedOutput:
        """The content (None when there is none), calls and ending of a whole output."""
        stream = self.stream()
        parsed = stream.feed(text).extend(stream.finish())
        calls: list[ToolCall] = []
        for delta in parsed.calls:
            if delta.id is not None:
                calls.append(ToolCall(delta.name or "", delta.arguments, delta.id))
            else:
                calls[delta.index] = dataclasses.replace(
                    calls[delta.index], arguments=calls[delta.index].arguments + delta.arguments)
        return ParsedOutput(parsed.content or None, calls, stream.ending())


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# ---- hermes -------------------------------------------------------------------------------------

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_HERMES_KEYS = ("arguments",)


class _Hermes(Enum):
    TEXT = "text"  # content, watching for an opening tag
    BLOCK = "block"  # inside a block: its call object is being read
    TAIL = "tail"  # a call's object ended: skipping to the closing tag (or the next block)
    NOT_A_CALL = "not a call"  # a block that is content: passed on up to its closing tag (or the next block)


class _HermesStream(StreamingToolParser):
    def __init__(self, *, forced: bool) -> None:
        super().__init__()
        self._forced = forced
        self._mode = _Hermes.TEXT
        self._buffer = ""  # text held for a tag that may be starting
        self._block = ""  # a block's text while it may still turn out not to be a call
        self._call: _CallStream | None = None
        self._content = _TrimmedText()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        while text:
            text = self._step(text, out)
        return out

    def _step(self, text: str, out: ParsedDelta) -> str:
        """Reads from the start of `text` in the current mode; returns the rest, for the next."""
        if self._mode is _Hermes.BLOCK:
            return self._read_block(text, out)
        buffer, self._buffer = self._buffer + text, ""
        # after a block, a new opening tag before the closing one starts the next block (a
        # model that left out a closing tag)
        markers = (HERMES_OPEN,) if self._mode is _Hermes.TEXT else (HERMES_CLOSE, HERMES_OPEN)
        found, marker = min(((buffer.find(m), m) for m in markers if m in buffer), default=(-1, ""))
        if found < 0:
            held = max(held_prefix(buffer, m) for m in markers)
            self._pass(buffer[:len(buffer) - held], out)
            self._buffer = buffer[len(buffer) - held:]
            return ""
        if marker == HERMES_OPEN:
            self._pass(buffer[:found], out)
            self._mode, self._block, self._in_call = _Hermes.BLOCK, "", False
            self._call = self._new_call(_HERMES_KEYS, needs_arguments=False)
        else:  # the closing tag of a block: content if the block was, else skipped with its tail
            self._pass(buffer[:found + len(marker)], out)
            self._mode, self._in_call = _Hermes.TEXT, False
        return buffer[found + len(marker):]

    def _pass(self, text: str, out: ParsedDelta) -> None:
        """Text outside calls: content, unless skipped (a call's tail) or forced output."""
        if self._mode is not _Hermes.TAIL and not self._forced:
            out.content += self._content.add(text)

    def _read_block(self, text: str, out: ParsedDelta) -> str:
        call = self._call
        assert call is not None
        used = call.feed(text, out)
        self._begun(call)
        if not call.started:
            self._block += text[:used]
        if not call.ended:
            return ""
        if call.started:
            self._close(call, out, at_end=True, empty_arguments="{}")  # at its end until the tag
            self._mode = _Hermes.TAIL
        else:  # the block is content, as written
            self._mode = _Hermes.NOT_A_CALL
            self._pass(HERMES_OPEN + self._block, out)
        self._call, self._block = None, ""
        return text[used:]

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode is _Hermes.BLOCK and self._call is not None:
            if self._call.started:
                self._close(self._call, out, at_end=True, empty_arguments="{}")
            else:
                self._pass(HERMES_OPEN + self._block, out)
        else:
            self._pass(self._buffer, out)
        self._mode, self._buffer, self._block, self._call = _Hermes.TEXT, "", "", None
        return out


class HermesParser(ToolParser):
    name = "hermes"

    def __init__(self, *, forced: bool = False) -> None:
        self.forced = forced

    def stream(self) -> StreamingToolParser:
        return _HermesStream(forced=self.forced)


# ---- llama3_json --------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = re.compile(r"[\s;]*")
_LLAMA3_KEYS = ("parameters", "arguments")


class _Llama3(Enum):
    START = "start"  # nothing but whitespace (or part of the python tag) yet
    BETWEEN = "between"  # before a call: skipping separators
    CALL = "call"  # a call object is being read
    TAIL = "tail"  # text after the calls: content, trimmed
    ALL = "all"  # the output is not calls: all of it is content, as written


class _Llama3Stream(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = _Llama3.START
        self._output: str | None = ""  # the whole output, until a call begins (it may be content)
        self._object = ""  # a call object's text while it may still turn out not to be a call
        self._call: _CallStream | None = None
        self._tail = _TrimmedText()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._output is not None:
            self._output += text
        if self._mode is _Llama3.START:
            text = self._start()
        while text:
            text = self._step(text, out)
        if self._mode is _Llama3.ALL and self._output is not None:
            out.content += self._output  # everything so far, this piece included
            self._output = None
        return out

    def _start(self) -> str:
        """Decides from the output's first characters whether it may be calls; the text
        after what the decision took."""
        assert self._output is not None
        head = self._output.lstrip()
        if head.startswith("{"):
            self._mode = _Llama3.BETWEEN
            return head
        if head.startswith(PYTHON_TAG):
            self._mode = _Llama3.BETWEEN
            return head[len(PYTHON_TAG):]
        if head and not PYTHON_TAG.startswith(head):
            self._mode = _Llama3.ALL
        return ""

    def _step(self, text: str, out: ParsedDelta) -> str:
        if self._mode is _Llama3.ALL:
            if self._output is None:
                out.content += text
            return ""
        if self._mode is _Llama3.TAIL:
            out.content += self._tail.add(text)
            return ""
        if self._mode is _Llama3.BETWEEN:
            text = text[_SEPARATORS.match(text).end():]  # type: ignore[union-attr]
            if text:
                if text[0] == "{":
                    self._mode, self._object = _Llama3.CALL, ""
                    self._call = self._new_call(_LLAMA3_KEYS, needs_arguments=True)
                else:
                    self._not_calls()
            return text
        return self._read_call(text, out)

    def _read_call(self, text: str, out: ParsedDelta) -> str:
        call = self._call
        assert call is not None
        used = call.feed(text, out)
        self._begun(call)
        if call.started:
            self._output = None
        else:
            self._object += text[:used]
        if not call.ended:
            return ""
        if call.started:
            self._close(call, out, at_end=False)
            self._mode = _Llama3.BETWEEN
            rest = text[used:]
        else:  # not a call: content from here
            rest = self._object + text[used:]
            self._not_calls()
        self._call, self._object = None, ""
        return rest

    def _not_calls(self) -> None:
        """What follows is content: after calls, trimmed; with none, the whole output."""
        self._mode = _Llama3.ALL if self.num_calls == 0 else _Llama3.TAIL

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        call = self._call
        if self._mode is _Llama3.CALL and call is not None:
            if call.started:
                self._close(call, out, at_end=True)
            elif self.num_calls:
                out.content += self._tail.add(self._object)
        if self.num_calls == 0 and self._output is not None:
            out.content += self._output  # nothing became a call: all content, as written
        self._mode, self._output, self._call, self._object = _Llama3.START, "", None, ""
        return out


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> StreamingToolParser:
        return _Llama3Stream()


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
