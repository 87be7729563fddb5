"""Tool-call parsers (whole text, and streamed split at every character boundary and at random)
and the Hermes-style rendering of tools for templates that cannot render them.

A stream must send each call as OpenAI does (a first delta with id and name and arguments "",
then arguments text) and add up, whatever the split, to what `parse` gives for the whole text.
"""

from __future__ import annotations

import json
import random

import pytest

from streamengine.server.tools import ToolStreams, finish_reason
from streamengine.structured.tool_calls import (
    TOOL_PARSERS,
    CallsEnding,
    HermesParser,
    ParsedDelta,
    ToolParser,
    get_tool_parser,
)
from streamengine.structured.tool_prompt import (
    render_messages,
    template_renders_tools,
    tool_call_lark,
)

WEATHER_ARGS = '{"city": "Paris", "unit": "c"}'
WEATHER = '{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}"
DONE = CallsEnding()  # no calls
ONE = CallsEnding(1)  # one complete call, closed

HERMES_CASES = [
    # (text, content, [(name, arguments text)], ending)
    ("Hello there.", "Hello there.", [], DONE),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER_ARGS)], ONE),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "now", "arguments": {}}</tool_call>',
     "Let me check.", [("get_weather", WEATHER_ARGS), ("now", "{}")], CallsEnding(2)),
    (f"a <tool_call>{WEATHER}</tool_call> b", "a  b", [("get_weather", WEATHER_ARGS)], ONE),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", [], DONE),
    ('<tool_call>{"no": "name"}</tool_call>', '<tool_call>{"no": "name"}</tool_call>', [], DONE),
    ('<tool_call>{"name": 5}</tool_call>x', '<tool_call>{"name": 5}</tool_call>x', [], DONE),
    # no closing tag: complete arguments are a complete call, ended inside its markup
    (f"<tool_call>{WEATHER}", None, [("get_weather", WEATHER_ARGS)], CallsEnding(1, True, True)),
    ('<tool_call>{"name": "x", "arguments": {"a": 1}', None, [("x", '{"a": 1}')], CallsEnding(1, True, True)),
    # cut inside the arguments: a partial call
    ('<tool_call>{"name": "x", "arguments": {', None, [("x", "{")], CallsEnding(1, False, True)),
    ('<tool_call>{"name": "x", "argu', None, [("x", "")], CallsEnding(1, False, True)),
    ('<tool_call>{"name": "x"', None, [("x", "")], CallsEnding(1, False, True)),
    # cut before the name is known: not a call (yet), so content
    ('<tool_call>{"name": "x', '<tool_call>{"name": "x', [], DONE),
    # the model's own text of the arguments, spacing and all
    ('<tool_call>{"name":"x","arguments":{ "a" :[1, {"b":"}]"}] ,"c":null}}</tool_call>', None,
     [("x", '{ "a" :[1, {"b":"}]"}] ,"c":null}')], ONE),
    # arguments before the name: held until the name is known
    ('<tool_call>{"arguments": {"q": "x"}, "name": "find"}</tool_call>', None, [("find", '{"q": "x"}')], ONE),
    # arguments sent as JSON text are decoded, escapes and surrogate pairs included
    ('<tool_call>{"name": "x", "arguments": "{\\"k\\": \\"\\u00e9\\ud83d\\ude00\\\\n\\"}"}</tool_call>', None,
     [("x", '{"k": "é😀\\n"}')], ONE),
    ('<tool_call>{"name": "x"}</tool_call>', None, [("x", "{}")], ONE),  # no arguments: {}
    # a closing tag inside a string is text; outside one it ends the block (a cut call)
    ('<tool_call>{"name": "x", "arguments": {"t": "</tool_call>"}}</tool_call>', None,
     [("x", '{"t": "</tool_call>"}')], ONE),
    ('<tool_call>{"name": "x", "arguments": {"a": 1</tool_call> after', "after", [("x", '{"a": 1')],
     CallsEnding(1, False, False)),
    ('<tool_call>{"name": "x", "arguments": {"a": "\\q"}}</tool_call>', None, [("x", '{"a": "\\')],
     CallsEnding(1, False, False)),  # an invalid escape ends the arguments before it
    ('<tool_call>{"name": "x", "arguments": [1, 2]}</tool_call>', None, [("x", "[1, 2]")], ONE),
    # a block that leaves out its closing tag ends where the next one opens
    ('<tool_call>{"name": "a", "arguments": {}} <tool_call>{"name": "b", "arguments": {}}</tool_call>', None,
     [("a", "{}"), ("b", "{}")], CallsEnding(2)),
    ("<tool_call>oops <tool_call>" + WEATHER + "</tool_call>", "<tool_call>oops", [("get_weather", WEATHER_ARGS)],
     ONE),
    ('<tool_call>{"name": "a", "arguments": {}} <tool_call>{"na', '<tool_call>{"na', [("a", "{}")], ONE),
    ("1 < 2 and <tool <tool_ca", "1 < 2 and <tool <tool_ca", [], DONE),
    ("  \n ", None, [], DONE),
]

LLAMA3_CASES = [
    ("The weather is fine.", "The weather is fine.", [], DONE),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", '{"city": "Oslo"}')], ONE),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', None,
     [("a", "{}"), ("b", '{"x": 1}')], CallsEnding(2)),
    ('{"name": "a", "arguments": {"y": 2}} and then text', "and then text", [("a", '{"y": 2}')], ONE),
    ('{"name": "a", "parameters": {}}\n tail \n', "tail", [("a", "{}")], ONE),
    ('{"name": "a", "parameters": {}}; {"x": 1} tail', '{"x": 1} tail', [("a", "{}")], ONE),
    ('{"not": "a call"}', '{"not": "a call"}', [], DONE),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', [], DONE),  # a JSON answer, not a call
    ('  {"name": "Bob"', '  {"name": "Bob"', [], DONE),  # no parameters yet: not a call yet
    ('{"name": "a", "parameters": {', None, [("a", "{")], CallsEnding(1, False, True)),
    ('{"name": "a", "parameters": {"k": [1]}', None, [("a", '{"k": [1]}')], CallsEnding(1, True, True)),
    ('{"parameters": {"k": 1}, "name": "a"}', None, [("a", '{"k": 1}')], ONE),
    ("<|python_tag|>", "<|python_tag|>", [], DONE),
    ("<|python", "<|python", [], DONE),
    ("<|python_tag|> hello", "<|python_tag|> hello", [], DONE),
    (" \n", " \n", [], DONE),
]


def _assembled(deltas) -> list[tuple[str, str]]:
    """The calls a stream's deltas add up to, checking they come as OpenAI sends them."""
    calls: list[list] = []
    for delta in deltas:
        if delta.id is not None:  # a call opens: id and name, no arguments yet
            assert delta.index == len(calls) and delta.id.startswith("call_") and delta.name, delta
            assert delta.arguments == "", delta
            calls.append([delta.name, ""])
        else:
            assert delta.name is None and 0 <= delta.index < len(calls) and delta.arguments, delta
            calls[delta.index][1] += delta.arguments
    return [tuple(call) for call in calls]


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], CallsEnding]:
    content, deltas = "", []
    stream = parser.stream()
    for piece in pieces:
        step = stream.feed(piece)
        content += step.content
        deltas += step.calls
    end = stream.finish()
    content += end.content
    deltas += end.calls
    return content, _assembled(deltas), stream.ending()


def _random_splits(text: str, rng: random.Random, count: int) -> list[list[str]]:
    splits = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return splits


def _check(parser: ToolParser, text: str, content: str | None, expected: list, ending: CallsEnding) -> None:
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == expected
    assert parsed.ending == ending
    # every split into two pieces, one character at a time, and random splits add up to the parse
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    splits += _random_splits(text, random.Random(text), 20)
    for pieces in splits:
        streamed_content, streamed_calls, streamed_ending = _streamed(parser, pieces)
        assert (streamed_content or None, streamed_calls, streamed_ending) == (content, expected, ending), pieces


@pytest.mark.parametrize(("text", "content", "expected", "ending"), HERMES_CASES)
def test_hermes(text, content, expected, ending):
    _check(get_tool_parser("hermes"), text, content, expected, ending)


@pytest.mark.parametrize(("text", "content", "expected", "ending"), LLAMA3_CASES)
def test_llama3_json(text, content, expected, ending):
    _check(get_tool_parser("llama3_json"), text, content, expected, ending)


def test_forced_hermes_has_no_content_and_drops_an_unnamed_block():
    forced = HermesParser(forced=True)
    _check(forced, f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER_ARGS)], ONE)
    _check(forced, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None,
           [("get_weather", '{"city": "Pa')], CallsEnding(1, False, True))
    _check(forced, '<tool_call>\n{"name": "get_wea', None, [], DONE)  # cut before the name
    _check(forced, f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{{", None, [("get_weather", WEATHER_ARGS)], ONE)


def test_a_call_streams_as_it_is_written():
    """The id and name go out once the name's string closes; the arguments as they come, with
    nothing held back but a string escape that is not finished."""
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Sure, ").content == "Sure,"  # trailing space held until more follows
    assert stream.feed("one moment <tool").content == " one moment"  # a possible tag is held
    assert stream.feed('_call>\n{"name": "get_wea') == ParsedDelta()  # the name is not known yet
    (opened,) = stream.feed('ther", "arguments"').calls
    assert (opened.index, opened.name, opened.arguments) == (0, "get_weather", "")
    assert opened.id.startswith("call_") and len(opened.id) > len("call_")
    assert [(d.index, d.id, d.arguments) for d in stream.feed(': {"city": "Pa').calls] == [(0, None, '{"city": "Pa')]
    assert [d.arguments for d in stream.feed('ris"}').calls] == ['ris"}']
    assert stream.feed("}\n</tool_call>") == ParsedDelta()
    assert stream.ending() == CallsEnding(1, True, False)

    as_text = get_tool_parser("llama3_json").stream()  # arguments sent as JSON text, decoded
    assert [d.name for d in as_text.feed('{"name": "f", "parameters": "{\\"k\\": \\"a').calls] == ["f", None]
    assert [d.arguments for d in as_text.feed("\\u00").calls] == []  # half an escape is held
    assert [d.arguments for d in as_text.feed('e9\\"}"}').calls] == ['\u00e9"}']


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: hermes, llama3_json"):
        get_tool_parser("nope")


def test_call_ids_are_distinct():
    calls = get_tool_parser("hermes").parse(f"<tool_call>{WEATHER}</tool_call>" * 2).calls
    assert len({c.id for c in calls}) == 2


# ---- random outputs: the stream adds up to the parse, and arguments are the model's text ----------


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else []))
    if kind == "str":
        return "".join(rng.choice('ab "\\}{]<>/é😀\n\t') for _ in range(rng.randint(0, 6)))
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return _random_object(rng, depth + 1)
    return {"int": rng.randint(-99, 99), "float": rng.random() * 1e3, "bool": rng.random() < 0.5, "null": None}[kind]


def _random_object(rng: random.Random, depth: int = 0) -> dict:
    return {f"k{i}" + rng.choice(["", "}", "\\", "é"]): _random_json(rng, depth) for i in range(rng.randint(0, 4))}


def _json_text(value, rng: random.Random) -> str:
    separators = rng.choice([(", ", ": "), (",", ":"), (" ,", " : ")])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=separators,
                      indent=rng.choice([None, None, 2]))


def _random_output(parser_name: str, rng: random.Random) -> tuple[str, list[tuple[str, str]], str]:
    """An output of several calls with random arguments, the calls as (name, arguments text),
    and the content around them."""
    calls = [(f"fn_{i}", _json_text(_random_object(rng), rng)) for i in range(rng.randint(1, 4))]
    if parser_name == "hermes":
        blocks = [f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>' for name, args in calls]
        return "Let me look.\n" + "\n".join(blocks), calls, "Let me look."
    objects = [f'{{"name": "{name}", "parameters": {args}}}' for name, args in calls]
    return "<|python_tag|>" + "; ".join(objects) + " That is all.", calls, "That is all."


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
def test_random_outputs_stream_as_they_parse(parser_name):
    rng = random.Random(parser_name)
    parser = get_tool_parser(parser_name)
    for _ in range(60):
        text, calls, content = _random_output(parser_name, rng)
        parsed = parser.parse(text)
        assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == (content, calls)
        for pieces in _random_splits(text, rng, 6):
            assert _streamed(parser, pieces) == (content, calls, parsed.ending)
        # cut anywhere (max_tokens): whatever was streamed is what the parse of the cut text gives,
        # and each call's arguments are a prefix of the whole ones
        cut = text[:rng.randint(0, len(text))]
        cut_parsed = parser.parse(cut)
        cut_calls = [(c.name, c.arguments) for c in cut_parsed.calls]
        for (name, args), (full_name, full_args) in zip(cut_calls, calls, strict=False):
            assert name == full_name and full_args.startswith(args), (cut, args)
        for pieces in _random_splits(cut, rng, 3):
            streamed_content, streamed_calls, ending = _streamed(parser, pieces)
            assert (streamed_content or None, streamed_calls, ending) == (cut_parsed.content, cut_calls,
                                                                           cut_parsed.ending)


# ---- finish reasons and the streams of a request's samples ---------------------------------------


@pytest.mark.parametrize(("reason", "ending", "expected"), [
    ("stop", DONE, "stop"),
    ("length", DONE, "length"),
    ("stop", ONE, "tool_calls"),
    ("length", ONE, "length"),  # cut after a whole call: more may have followed
    ("length", CallsEnding(1, True, True), "tool_calls"),  # cut in the closing markup only
    ("length", CallsEnding(1, False, True), "length"),  # cut in the arguments
    ("stop", CallsEnding(2, False, False), "stop"),  # a broken call is not a clean tool_calls end
    ("abort", ONE, "abort"),
    (None, ONE, None),
])
def test_finish_reason(reason, ending, expected):
    assert finish_reason(reason, ending) == expected


def test_tool_streams_flush_what_a_sample_left_unfinished_held_back():
    """A WebSocket request aborted between two outputs never sees its samples' last delta:
    flush() gives back what each parser still held (here an unnamed block), once."""
    streams = ToolStreams(get_tool_parser("hermes"))
    held = 'Sure.<tool_call>\n{"na'
    first = streams.feed(0, held, last=False)
    done = streams.feed(1, "plain answer", last=True)
    assert first.content == "Sure." and not first.calls and done.content == "plain answer"
    flushed = streams.flush()
    assert set(flushed) == {0}  # sample 1 had finished
    assert first.content + flushed[0].content == held and not flushed[0].calls
    assert streams.flush() == {}
    assert streams.finish_reason(1, "stop") == "stop" and streams.finish_reason(5, "length") == "length"


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
    assert [(c.name, c.arguments) for c in get_tool_parser("hermes").parse(render_messages(messages, None)[1]["content"]).calls] == [
        ("now", '{"tz": "UTC"}')]
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
    from streamengine.server.config import ServerConfig
    from streamengine.server.state import ServerState

    engine = _TemplateEngine("{% if tools %}{{ tools }}{% endif %}")
    state = ServerState(engine, ServerConfig(), "m", None, None, None)  # type: ignore[arg-type]
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}
    messages = [{"role": "user", "content": "t?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert state.chat_prompt(messages, FUNCTIONS) == "prompt"
    _, seen, tools = engine.seen
    assert tools == [{"type": "function", "function": FUNCTIONS[0]}]
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}  # templates `tojson` a dict
