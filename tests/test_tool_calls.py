"""Tool-call parsers (whole text, and streamed split at every character boundary) and the
Hermes-style rendering of tools for templates that cannot render them."""

from __future__ import annotations

import json

import pytest

from streamengine.tool_calls import TOOL_PARSERS, ToolCall, get_tool_parser
from streamengine.tool_prompt import render_messages, template_renders_tools, tool_call_lark

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'

HERMES_CASES = [
    # (text, content, [(name, arguments)])
    ("Hello there.", "Hello there.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "now", "arguments": {}}</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "c"}), ("now", {})]),
    (f"a <tool_call>{WEATHER}</tool_call> b", "a  b", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    (f"<tool_call>{WEATHER}", None, [("get_weather", {"city": "Paris", "unit": "c"})]),  # no closing tag
    ("<tool_call>{\"name\": \"x\", \"arguments\": {", "<tool_call>{\"name\": \"x\", \"arguments\": {", []),
    ('<tool_call>{"name": "x", "arguments": "{\\"k\\": 1}"}</tool_call>', None, [("x", {"k": 1})]),
    ("1 < 2 and <tool <tool_ca", "1 < 2 and <tool <tool_ca", []),
    ("  \n ", None, []),
]

LLAMA3_CASES = [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', None,
     [("a", {}), ("b", {"x": 1})]),
    ('{"name": "a", "arguments": {"y": 2}} and then text', "and then text", [("a", {"y": 2})]),
    ('{"name": "a", "parameters": {}}\n tail \n', "tail", [("a", {})]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # a JSON answer, not a call
    ('{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),
    ("<|python", "<|python", []),
    (" \n", " \n", []),
]


def _shape(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    stream = get_tool_parser(parser_name).stream()
    content, calls = "", []
    for piece in pieces:
        out = stream.feed(piece)
        content += out.content
        calls += [(d.index, d.name, d.arguments) for d in out.calls]
    out = stream.finish()
    content += out.content
    calls += [(d.index, d.name, d.arguments) for d in out.calls]
    return content, calls


def _check(parser_name: str, text: str, content: str | None, expected: list) -> None:
    parsed_content, calls = get_tool_parser(parser_name).parse(text)
    assert parsed_content == content
    assert _shape(calls) == expected
    whole = [(i, c.name, c.arguments) for i, c in enumerate(calls)]
    # every split into two pieces, and one character at a time, add up to the whole parse
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        streamed_content, streamed_calls = _streamed(parser_name, pieces)
        assert (streamed_content or None, streamed_calls) == (content, whole), pieces


@pytest.mark.parametrize(("text", "content", "expected"), HERMES_CASES)
def test_hermes(text, content, expected):
    _check("hermes", text, content, expected)


@pytest.mark.parametrize(("text", "content", "expected"), LLAMA3_CASES)
def test_llama3_json(text, content, expected):
    _check("llama3_json", text, content, expected)


def test_content_streams_before_the_output_ends():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Sure, ").content == "Sure,"  # trailing space held until more follows
    assert stream.feed("one moment <tool").content == " one moment"  # a possible tag is held
    out = stream.feed(f"_call>{WEATHER}</tool_call>")
    assert out.content == "" and [(d.index, d.name) for d in out.calls] == [(0, "get_weather")]
    assert out.calls[0].id.startswith("call_") and len(out.calls[0].id) > len("call_")


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: hermes, llama3_json"):
        get_tool_parser("nope")


def test_call_ids_are_distinct():
    _, calls = get_tool_parser("hermes").parse(f"<tool_call>{WEATHER}</tool_call>" * 2)
    assert len({c.id for c in calls}) == 2


# ---- tool_prompt: tools and tool turns for a template that renders neither ----------------------

FUNCTIONS = [{"name": "now", "description": "The time.", "parameters": {"type": "object"}}]


def test_tools_go_into_the_system_message():
    plain = [{"role": "user", "content": "hi"}]
    assert render_messages(plain, None) == plain
    (system, user) = render_messages(plain, FUNCTIONS)
    assert system["role"] == "system" and user == plain[0]
    assert '<tools>\n{"type": "function", "function": {"name": "now"' in system["content"]
    assert "<tool_call>" in system["content"]
    (system, _) = render_messages([{"role": "system", "content": "Be brief."}, *plain], FUNCTIONS)
    assert system["content"].startswith("Be brief.\n\n") and "<tools>" in system["content"]


def test_calls_and_results_render_hermes_style():
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_2", "content": "13:00"},
        {"role": "assistant", "content": "Noon."},
    ]
    assert render_messages(messages, None) == [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>"},
        {"role": "assistant", "content": "Noon."},
    ]
    # what the model is shown is what the hermes parser reads back
    assert _shape(get_tool_parser("hermes").parse(render_messages(messages, None)[1]["content"])[1]) == [
        ("now", {"tz": "UTC"})]
    bad = [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "now", "arguments": "{"}}]}]
    with pytest.raises(ValueError, match="tool call 'c': arguments are not valid JSON"):
        render_messages(bad, None)


def test_template_detection_and_the_forcing_grammar():
    assert not template_renders_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    one = tool_call_lark(FUNCTIONS)
    assert one.startswith("start: block\n") and '"name": {"const": "now"}' in one
    assert tool_call_lark(FUNCTIONS, parallel=True).startswith('start: block ("\\n" block)*\n')
    assert "call: call_0 | call_1" in tool_call_lark(FUNCTIONS * 2)
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_lark([])


class _TemplateEngine:
    """A stand-in engine whose template renders tools itself (the call is recorded)."""

    def __init__(self, template: str) -> None:
        self.tokenizer = self
        self.chat_template = template
        self.seen: tuple | None = None

    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=False):
        self.seen = ("tokenizer", messages, tools)
        return "prompt"


def test_server_prompt_uses_a_tools_template_natively():
    from streamengine.server.state import ServerState

    engine = _TemplateEngine("{% if tools %}{{ tools }}{% endif %}")
    state = ServerState(engine, "m", None, None, None, None)  # type: ignore[arg-type]
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}
    messages = [{"role": "user", "content": "t?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert state.chat_prompt(messages, FUNCTIONS) == "prompt"
    _, seen, tools = engine.seen
    assert tools == [{"type": "function", "function": FUNCTIONS[0]}]
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}  # templates `tojson` a dict


def test_tool_streams_flush_what_a_sample_left_unfinished_held_back():
    """A WebSocket request aborted between two outputs never sees its samples' last delta:
    flush() gives back the text each parser still held (here an unfinished call), once."""
    from streamengine.server.tools import ToolStreams

    streams = ToolStreams(get_tool_parser("hermes"))
    held = 'Sure.<tool_call>\n{"name": "note", "'
    first = streams.feed(0, held, last=False)
    done = streams.feed(1, "plain answer", last=True)
    assert first.content == "Sure." and not first.calls and done.content == "plain answer"
    flushed = streams.flush()
    assert set(flushed) == {0}  # sample 1 had finished
    assert first.content + flushed[0].content == held and not flushed[0].calls
    assert streams.flush() == {}
