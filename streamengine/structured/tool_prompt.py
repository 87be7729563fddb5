"""Tools in the prompt, and the grammar that forces a tool call.

A chat template that knows tools (its text mentions `tools`) renders them itself. One that
does not, such as the default SmolLM2's (role and content only), gets them Hermes-style from
here: the function signatures in the system message, earlier calls of the assistant as
`<tool_call>` blocks in its content, and tool results as `<tool_response>` blocks in a user
turn. The model is asked to answer in the same `<tool_call>` form, which the "hermes" parser
(tool_calls.py) reads back.

`tool_call_lark` is the Lark grammar (llguidance's, with inline `%json` schemas) that limits
an output to such a call: of one named function, or of any of the tools (tool_choice
"required"). The server wraps it into the `grammar` structured output.

Functions here take OpenAI's shapes as plain dicts: a tool's function is `{"name",
"description", "parameters", "strict"}`; a message may carry `tool_calls` (`[{"id", "function": {"name",
"arguments"}}]`, arguments as JSON text) or, for role "tool", `tool_call_id`.
"""

from __future__ import annotations

import json
from typing import Any

from streamengine.structured.json_schema import normalize_schema
from streamengine.structured.params import JSON_LAYOUT
from streamengine.structured.tool_calls import HERMES_CLOSE, HERMES_OPEN

Message = dict[str, Any]

_TOOLS_PREAMBLE = (
    "You can call functions to answer the user. Their signatures, as JSON, are inside <tools></tools>:\n"
)
_TOOLS_INSTRUCTIONS = (
    "To call a function, reply with a JSON object of its name and arguments inside "
    f"{HERMES_OPEN}{HERMES_CLOSE} tags, like this:\n"
    f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{HERMES_CLOSE}'
)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (it refers to them)."""
    return chat_template is not None and "tools" in chat_template


def tools_system_text(functions: list[dict[str, Any]]) -> str:
    """The system-message block that lists the tools and says how to call them."""
    # "strict" is how the server holds the arguments to the schema, nothing the model needs to read.
    shown = [{k: v for k, v in f.items() if k != "strict"} for f in functions]
    lines = [json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in shown]
    return _TOOLS_PREAMBLE + "<tools>\n" + "\n".join(lines) + "\n</tools>\n" + _TOOLS_INSTRUCTIONS


def needs_tools_template(messages: list[Message], functions: list[dict[str, Any]] | None) -> bool:
    """Whether rendering involves tools at all: tools given, earlier calls or tool results."""
    return bool(functions) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def template_messages(messages: list[Message]) -> list[Message]:
    """Messages for a template that renders tools: as OpenAI's, but each call's arguments
    decoded (templates write them with `tojson`)."""
    return [{**m, "tool_calls": [_template_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {**call, "function": {**function, "arguments": _arguments(call)}}


def render_messages(messages: list[Message], functions: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Role-and-content messages for a template that knows no tools (see the module doc).

    `functions` None or empty: no tools block (tool_choice "none", or no tools given); earlier
    calls and tool results are still rendered so a follow-up request is understood.
    """
    rendered: list[dict[str, str]] = []
    after_tool = False  # the previous message was a tool result: results of one turn share a user turn
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if after_tool:
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block})
            after_tool = True
            continue
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call) for call in message["tool_calls"]]
            content = "\n".join([content, *blocks] if content else blocks)
        rendered.append({"role": role, "content": content})
        after_tool = False
    return _with_tools(rendered, functions) if functions else rendered


def _call_block(call: dict[str, Any]) -> str:
    name = (call.get("function") or {}).get("name")
    body = json.dumps({"name": name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads((call.get("function") or {}).get("arguments") or "{}")
    except ValueError:
        raise ValueError(f"tool call {call.get('id')!r}: arguments are not valid JSON") from None


def _with_tools(messages: list[dict[str, str]], functions: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The tools block appended to the system message (one is added first if there is none)."""
    block = tools_system_text(functions)
    if messages and messages[0]["role"] == "system":
        head = messages[0]["content"]
        return [{"role": "system", "content": f"{head}\n\n{block}" if head else block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def tool_call_lark(functions: list[dict[str, Any]], *, parallel: bool = False) -> str:
    """Lark grammar of `<tool_call>` blocks calling one of `functions` with valid arguments.

    One call, or with `parallel` one or more separated by newlines. A named tool_choice passes
    that one function. Each function's parameters are held to its schema as json_schema.py
    says, strictly unless the function says `"strict": false`.
    """
    if not functions:
        raise ValueError("a forced tool call needs at least one tool")
    alternatives = [f"call_{i}" for i in range(len(functions))]
    block = f'"{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"'
    lines = [
        'start: block ("\\n" block)*' if parallel else "start: block",
        f"block: {block}",
        "call: " + " | ".join(alternatives),
    ]
    lines += [f"{alt}: %json {json.dumps(_call_schema(f), ensure_ascii=False)}"
              for alt, f in zip(alternatives, functions, strict=True)]
    return "\n".join(lines) + "\n"


_DEFINITIONS = ("$defs", "definitions")


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    # Held as a json_schema response format is (json_schema.py): unnamed arguments refused
    # unless the function says "strict": false or its schema allows them.
    parameters = normalize_schema(function.get("parameters") or _ANY_OBJECT, strict=function.get("strict") is not False)
    # The parser reads only an object as a call's arguments; a schema that does not say
    # "type": "object" (say, just properties and required) also allows strings, arrays and
    # false, which would make a forced call come back as content. One whose type excludes
    # objects is then unsatisfiable: a 400 invalid_grammar.
    arguments = parameters if parameters.get("type") == "object" else {"allOf": [_ANY_OBJECT, parameters]}
    schema = {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_LAYOUT,  # one line, spaced as the prompt's example
    }
    # The parameters' references ("#/$defs/Item", as pydantic writes nested models) point at
    # their own root, which here is the call's: its definitions go up there too (as vLLM does).
    for key in _DEFINITIONS:
        if isinstance(parameters.get(key), dict):
            schema[key] = parameters[key]
    return schema
