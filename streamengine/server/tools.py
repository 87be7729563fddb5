"""What a request's `tools` and `tool_choice` mean, for the OpenAI routes and the WebSocket.

- "none": no tools in the prompt, no parsing: a plain answer.
- "auto" (the default when tools are given): tools in the prompt; the output is parsed for
  calls, which the model may or may not make.
- "required", or a named function: tools in the prompt and the output constrained by a grammar
  to a call (of any tool, or of the named one) whose arguments follow the tool's schema.

A forced call is one call; several only when the client sets parallel_tool_calls true itself
(OpenAI's default is true, but a small model forced into calls tends to repeat them until
max_tokens). The forced call is written Hermes-style (`<tool_call>{...}</tool_call>`), so it is read back
with the "hermes" parser in its forced form whatever the server's parser for free-form outputs
is: its markup is never content, and a call cut by max_tokens comes back partial.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from streamengine.structured.tool_calls import (
    CallsEnding,
    HermesParser,
    ParsedDelta,
    StreamingToolParser,
    ToolParser,
    get_tool_parser,
)
from streamengine.structured.tool_prompt import tool_call_lark

CHOICES = ("none", "auto", "required")
TOOL_CALLS = "tool_calls"  # the finish reason of an output that ended in tool calls


@dataclass(frozen=True, slots=True)
class ToolPlan:
    functions: list[dict[str, Any]] | None  # rendered into the prompt
    structured: dict[str, Any] | None  # the grammar that forces a call
    parser: ToolParser | None  # reads calls out of the output; None: outputs are plain text


NO_TOOLS = ToolPlan(None, None, None)


def plan_tools(tools: Sequence[Any], choice: Any, *, parallel: bool, parser_name: str) -> ToolPlan:
    """The plan for a request; ValueError (about tool_choice) for a choice that cannot be met.

    `tools`: OpenAI's tool objects of either protocol (`.function` with name, description,
    parameters). `choice`: one of CHOICES, a named choice (`.function.name`), or None (the
    default: "auto" with tools, else "none").
    """
    functions = [_function_dict(t.function) for t in tools]
    if choice is not None and not isinstance(choice, str):
        named = choice.function.name
        chosen = [f for f in functions if f["name"] == named]
        if not chosen:
            raise ValueError(f"tool_choice names function {named!r}, which is not among the tools")
        return ToolPlan(functions, _forcing(chosen, parallel=False), HermesParser(forced=True))
    choice = choice or ("auto" if functions else "none")
    if choice not in CHOICES:
        raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {choice!r}")
    if choice == "none" or (choice == "auto" and not functions):
        return NO_TOOLS
    if choice == "required":
        if not functions:
            raise ValueError('tool_choice "required" needs at least one tool')
        return ToolPlan(functions, _forcing(functions, parallel=parallel), HermesParser(forced=True))
    return ToolPlan(functions, None, get_tool_parser(parser_name))


def _function_dict(function: Any) -> dict[str, Any]:
    """A tool's function as tool_prompt.py takes it (fields that are not given left out)."""
    fields = {"name": function.name, "description": function.description, "parameters": function.parameters,
              "strict": function.strict}
    return {key: value for key, value in fields.items() if value is not None}


def _forcing(functions: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    return {"type": "grammar", "grammar": tool_call_lark(functions, parallel=parallel), "syntax": "lark"}


def finish_reason(reason: str | None, ending: CallsEnding) -> str | None:
    """A sample's finish reason once its output is parsed: "tool_calls" for one whose calls are
    all complete and that ended normally, or was cut by max_tokens only inside a call's closing
    markup (after its arguments); a call whose arguments were cut keeps "length" (as OpenAI)."""
    if ending.num_calls == 0 or not ending.all_complete:
        return reason
    if reason == "stop" or (reason == "length" and ending.in_call):
        return TOOL_CALLS
    return reason


class ToolStreams:
    """The streaming parsers of one request's samples, made as each sample first speaks."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._streams: dict[int, StreamingToolParser] = {}
        self._finished: set[int] = set()

    def feed(self, index: int, text: str, *, last: bool) -> ParsedDelta:
        """What `text` adds to sample `index`; with `last`, everything it still held too."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._parser.stream()
        parsed = stream.feed(text)
        if last:
            self._finished.add(index)
            parsed.extend(stream.finish())
        return parsed

    def flush(self) -> dict[int, ParsedDelta]:
        """Per sample not finished yet, what its parser still held back (a request left before
        its last output: an abort); each is finished then."""
        return {index: self.feed(index, "", last=True) for index in self._streams if index not in self._finished}

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        """Sample `index`'s finish reason, given how its calls ended (see `finish_reason`)."""
        stream = self._streams.get(index)
        return finish_reason(reason, stream.ending() if stream is not None else CallsEnding())
