"""A tool call's JSON object read as the model writes it, character by character.

`CallReader` follows one object `{"name": ..., <arguments key>: ..., ...}` through any split of
its text into pieces: the name is known once its string closes, and the arguments' text is
handed out as it is read, exactly as the model wrote it (an object's or array's raw text; a
string's decoded text, for models that send the arguments as JSON text), so that what a
stream sends adds up to what a parse of the whole output gives. It tracks strings and nesting
to know where each value ends, and stops at the object's closing brace or at the first
character that cannot continue it (such as the `<` of a closing tag).

It checks what it must to find the ends of values (string escapes, matching brackets, no
characters that JSON never has outside strings), not the whole JSON grammar: `{"a" 1}` inside
the arguments passes through as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from enum import Enum

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\]*')
# outside strings, the characters that change no state: whitespace, separators, scalars
_PLAIN = re.compile(r"[ \t\n\r,:0-9a-zA-Z.+\-]*")
_SCALAR = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.+-")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")


class Invalid(Exception):
    """The character at `at` cannot continue the JSON being read."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


def scan_string(text: str, pos: int, escape: int) -> tuple[int, int, bool]:
    """Reads a JSON string's body from `pos` in `text`: (where it stopped, the escape state
    there, whether the closing quote was read). `escape`: 0 outside an escape, 1 after a
    backslash, 2 to 5 awaiting the 1st to 4th hex digit of a `\\u` escape."""
    end = len(text)
    while pos < end:
        if escape == 0:
            pos = _STRING_RUN.match(text, pos).end()  # type: ignore[union-attr]
            if pos == end:
                break
            escape = 1 if text[pos] == "\\" else 0
            pos += 1
            if not escape:
                return pos, 0, True  # the closing quote
        elif escape == 1:
            char = text[pos]
            if char == "u":
                escape = 2
            elif char in _SIMPLE_ESCAPES:
                escape = 0
            else:
                raise Invalid(pos)
            pos += 1
        else:
            if text[pos] not in _HEX:
                raise Invalid(pos)
            escape = 0 if escape == 5 else escape + 1
            pos += 1
    return pos, escape, False


def _is_high_surrogate(hex_digits: str) -> bool:
    return hex_digits[:2].lower() in ("d8", "d9", "da", "db")


def decodable_end(raw: str, start: int) -> int:
    """How far a string body `raw` (valid escapes, read from `start`, a point between escapes)
    decodes to text that more characters cannot change: not inside an escape, and not between
    a high surrogate escape and the low one that may follow it."""
    pos, held = start, -1  # held: where a high surrogate escape ending at `pos` starts
    while pos < len(raw):
        if raw[pos] != "\\":
            found = raw.find("\\", pos)
            pos, held = (len(raw) if found < 0 else found), -1
            continue
        size = 6 if raw.startswith("u", pos + 1) else 2
        if pos + size > len(raw):
            return held if held >= 0 else pos
        held = pos if size == 6 and _is_high_surrogate(raw[pos + 2:pos + 4]) else -1
        pos += size
    return held if held >= 0 else len(raw)


def decode_body(raw: str) -> str:
    """The text of a JSON string body whose escapes are valid (control characters allowed)."""
    return json.loads(f'"{raw}"', strict=False)


class StringValue:
    """A JSON string being read (after its opening quote): its raw body, and its text handed
    out as far as it is settled."""

    __slots__ = ("_escape", "_taken", "done", "raw")

    def __init__(self) -> None:
        self.raw = ""
        self.done = False
        self._escape = 0
        self._taken = 0  # raw characters already decoded and handed out

    def feed(self, text: str, pos: int) -> int:
        """Reads from `pos`; returns where it stopped (after the closing quote once `done`)."""
        try:
            end, self._escape, self.done = scan_string(text, pos, self._escape)
        except Invalid as exc:
            self.raw += text[pos:exc.at]
            raise
        self.raw += text[pos:end - 1 if self.done else end]
        return end

    def text(self) -> str:
        return decode_body(self.raw)

    def take(self, *, final: bool = False) -> str:
        """Decoded text not handed out yet: all of it once done; else what more characters
        cannot change (with `final`, the output ended: all but an unfinished escape)."""
        if self.done:
            end = len(self.raw)
        else:
            end = decodable_end(self.raw, self._taken)
            if final:  # nothing follows: a lone high surrogate is text too
                end = _whole_escapes_end(self.raw, end)
        taken, self._taken = self.raw[self._taken:end], end
        return decode_body(taken) if taken else ""


def _whole_escapes_end(raw: str, end: int) -> int:
    """`end`, moved past a complete escape that starts there (a held high surrogate)."""
    return end + 6 if raw.startswith("\\u", end) and end + 6 <= len(raw) else end


class RawValue:
    """A JSON value other than a string, read as written: containers end at their matching
    bracket, scalars (numbers, true, false, null) at the first character after them."""

    __slots__ = ("_escape", "_scalar", "_stack", "done")

    def __init__(self, first: str) -> None:
        self._scalar = first not in "{["
        self._stack: list[str] = []  # closing brackets awaited
        self._escape = -1  # inside a string: its escape state (see scan_string); else -1
        self.done = False

    def feed(self, text: str, pos: int) -> int:
        """Reads from `pos`; returns where it stopped (at the end of the value once `done`)."""
        return self._feed_scalar(text, pos) if self._scalar else self._feed_container(text, pos)

    def _feed_scalar(self, text: str, pos: int) -> int:
        while pos < len(text) and text[pos] in _SCALAR:
            pos += 1
        self.done = pos < len(text)  # ended by the character after it, which is not its own
        return pos

    def _feed_container(self, text: str, pos: int) -> int:
        end = len(text)
        while pos < end:
            if self._escape >= 0:
                pos, self._escape, closed = scan_string(text, pos, self._escape)
                self._escape = -1 if closed else self._escape
                continue
            pos = _PLAIN.match(text, pos).end()  # type: ignore[union-attr]
            if pos == end:
                break
            char = text[pos]
            if char == '"':
                self._escape = 0
            elif char in "{[":
                self._stack.append("}" if char == "{" else "]")
            elif char in "}]" and self._stack and self._stack[-1] == char:
                self._stack.pop()
                if not self._stack:
                    self.done = True
                    return pos + 1
            else:
                raise Invalid(pos)
            pos += 1
        return pos


class ReaderState(Enum):
    READING = "reading"
    CLOSED = "closed"  # the object's closing brace was read
    FAILED = "failed"  # a character that cannot continue the object was met (not consumed)


class _Role(Enum):
    NAME = "name"
    ARGUMENTS = "arguments"
    OTHER = "other"  # a value that is read past and forgotten


Step = Callable[[str, int], int]


class CallReader:
    """Reads one call object, `{"name": ..., <arguments key>: ..., ...}`, as it is written.

    The first "name" key's value must be a string (else the reader fails); the first of
    `argument_keys` gives the arguments; other keys are read past. `feed` returns how much of
    its text the object took: all of it while READING, up to the closing brace when CLOSED,
    up to the character it cannot take when FAILED.
    """

    def __init__(self, argument_keys: tuple[str, ...]) -> None:
        self._argument_keys = argument_keys
        self.state = ReaderState.READING
        self.name: str | None = None
        self.has_arguments = False  # the arguments' value has begun
        self.arguments_done = False  # ... and ended
        self._arguments: list[str] = []  # arguments text read and not taken yet
        self._step: Step = self._open
        self._key = StringValue()
        self._empty = True  # no key read yet: `}` may close the object
        self._name_seen = False
        self._role = _Role.OTHER
        self._value: StringValue | RawValue | None = None

    def feed(self, text: str) -> int:
        pos = 0
        try:
            while pos < len(text) and self.state is ReaderState.READING:
                pos = self._step(text, pos)
        except Invalid as exc:
            self.state = ReaderState.FAILED
            return exc.at
        return pos

    def take_arguments(self, *, final: bool = False) -> str:
        """The arguments' text read since the last take. With `final` (the output ended), also
        what a string's unfinished end still held back."""
        if final and isinstance(self._value, StringValue) and self._role is _Role.ARGUMENTS:
            self._arguments.append(self._value.take(final=True))
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    # ---- one step per state: each reads from `pos` and returns where it stopped ----------------

    def _open(self, text: str, pos: int) -> int:
        return self._expect(text, pos, "{", self._key_start)

    def _key_start(self, text: str, pos: int) -> int:
        pos = _skip_whitespace(text, pos)
        if pos == len(text):
            return pos
        if text[pos] == '"':
            self._key, self._step = StringValue(), self._key_body
        elif text[pos] == "}" and self._empty:
            self.state = ReaderState.CLOSED
        else:
            raise Invalid(pos)
        return pos + 1

    def _key_body(self, text: str, pos: int) -> int:
        pos = self._key.feed(text, pos)
        if self._key.done:
            self._empty, self._step = False, self._colon
        return pos

    def _colon(self, text: str, pos: int) -> int:
        return self._expect(text, pos, ":", self._value_start)

    def _expect(self, text: str, pos: int, char: str, then: Step) -> int:
        """Past whitespace, `char` and then the step `then`; Invalid at anything else."""
        pos = _skip_whitespace(text, pos)
        if pos < len(text):
            if text[pos] != char:
                raise Invalid(pos)
            self._step, pos = then, pos + 1
        return pos

    def _value_start(self, text: str, pos: int) -> int:
        pos = _skip_whitespace(text, pos)
        if pos == len(text):
            return pos
        first = text[pos]
        self._role = self._role_of(self._key.text())
        if first == '"':
            self._value, pos = StringValue(), pos + 1
        elif self._role is _Role.NAME or not (first in "{[" or first in _SCALAR):
            raise Invalid(pos)  # a name that is not a string; or no JSON value starts so
        else:
            self._value = RawValue(first)
        if self._role is _Role.NAME:
            self._name_seen = True
        elif self._role is _Role.ARGUMENTS:
            self.has_arguments = True
        self._step = self._value_body
        return pos

    def _role_of(self, key: str) -> _Role:
        if key == "name" and not self._name_seen:
            return _Role.NAME
        if key in self._argument_keys and not self.has_arguments:
            return _Role.ARGUMENTS
        return _Role.OTHER

    def _value_body(self, text: str, pos: int) -> int:
        value = self._value
        assert value is not None
        try:
            end = value.feed(text, pos)
        except Invalid as exc:
            self._read(text, pos, exc.at)
            raise
        self._read(text, pos, end)
        if value.done:
            if self._role is _Role.NAME:
                self.name = value.text()  # type: ignore[union-attr]
            elif self._role is _Role.ARGUMENTS:
                self.arguments_done = True
            self._value, self._step = None, self._after_value
        return end

    def _read(self, text: str, start: int, end: int) -> None:
        """Passes on the arguments' part of what the value just read."""
        if self._role is not _Role.ARGUMENTS:
            return
        if isinstance(self._value, StringValue):
            self._arguments.append(self._value.take())
        else:
            self._arguments.append(text[start:end])

    def _after_value(self, text: str, pos: int) -> int:
        pos = _skip_whitespace(text, pos)
        if pos == len(text):
            return pos
        if text[pos] == ",":
            self._step = self._key_start
        elif text[pos] == "}":
            self.state = ReaderState.CLOSED
        else:
            raise Invalid(pos)
        return pos + 1


def _skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
