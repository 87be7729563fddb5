"""What users coming from vLLM and OpenAI expect of the HTTP API, through the real `openai`
client and aiohttp: batched completion prompts and echo, vLLM's request fields (structured
outputs in every spelling, prompt_logprobs, chat template options, beam search, truncation,
cache_salt, ...), the refusal of every field OpenAI or vLLM defines that this server does not
implement, stop_reason, and the tokenizer, version and model routes (also over the Ray
ingress's ClusterEngine)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest
from test_openai import KEY, live_server

import streamengine
from streamengine import AsyncEngine, EngineConfig
from streamengine.sample.sampling_params import SamplingParams
from streamengine.server.config import ServerConfig
from streamengine.server.openai import fields
from streamengine.server.openai.schemas import ChatCompletionRequest, CompletionRequest

openai = pytest.importorskip("openai")

IGNORE_EOS = {"ignore_eos": True}  # a random model may sample EOS at any point
GREEDY = {"temperature": 0, "extra_body": IGNORE_EOS}
CHAT = [{"role": "user", "content": "Say something."}]
PROMPTS = ["The cat", "A dog sat on the", "Hello"]
AUTH = {"Authorization": f"Bearer {KEY}"}
CHOICE_SCHEMA = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer",
                 "minimum": 0, "maximum": 9}}, "required": ["pet", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=160, max_num_seqs=16))


async def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(base, headers=AUTH) as http, http.post(path, json=body) as resp:
        return resp.status, await resp.json()


# ---- /v1/completions: batches of prompts ---------------------------------------------------------


async def test_a_list_of_prompts_gives_n_choices_per_prompt_in_order(engine):
    async with live_server(engine) as (client, _):
        singles = [await client.completions.create(model="tiny", prompt=p, n=2, max_tokens=4, **GREEDY)
                   for p in PROMPTS]
        batch = await client.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=4, **GREEDY)
        assert [c.index for c in batch.choices] == list(range(6))
        assert [c.text for c in batch.choices] == [c.text for r in singles for c in r.choices]
        assert len({c.text for c in batch.choices}) == 3  # three different prompts, greedy twice each
        assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in singles)
        assert batch.usage.completion_tokens == 3 * 2 * 4
        # the same prompts as token-id lists
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        as_ids = await client.completions.create(model="tiny", prompt=ids, n=2, max_tokens=4, **GREEDY)
        assert [c.text for c in as_ids.choices] == [c.text for c in batch.choices]
        # streamed: every chunk carries the global choice index; the stream assembles to the same
        stream = await client.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
        texts, finished, usage = [""] * 6, [], None
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason is not None:
                    finished.append(choice.index)
            usage = chunk.usage or usage
        assert texts == [c.text for c in batch.choices]
        assert sorted(finished) == list(range(6))
        assert usage.completion_tokens == 24 and usage.prompt_tokens == batch.usage.prompt_tokens


async def test_a_refused_prompt_fails_the_whole_batch_before_any_output(engine):
    async with live_server(engine, max_prompt_tokens=8) as (client, base):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt=["short", "word " * 30], max_tokens=2,
                                                stream=stream)
            assert info.value.code == "context_length_exceeded"
        for bad in (["a", [1, 2]], [[1], "a"], [], [[]]):
            status, body = await _post(base, "/v1/completions", {"prompt": bad, "max_tokens": 2})
            assert status == 400 and body["error"]["param"] == "prompt", (bad, body)
        status, body = await _post(base, "/v1/completions", {"prompt": ["a"] * 257, "max_tokens": 1})
        assert status == 400 and body["error"]["code"] == "limit_exceeded"
    assert engine.stats()["num_requests"] == 0


# ---- echo --------------------------------------------------------------------------------------


async def test_echo_puts_the_prompt_and_its_logprobs_before_each_choice(engine):
    prompt = "The quick brown fox"
    prompt_ids = engine.tokenizer.encode(prompt)
    async with live_server(engine) as (client, _):
        plain = await client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
        echoed = await client.completions.create(model="tiny", prompt=[prompt, prompt], echo=True, max_tokens=3,
                                                 **GREEDY)
        assert [c.text for c in echoed.choices] == [prompt + plain.choices[0].text] * 2
        assert echoed.choices[0].logprobs is None
        with_lp = await client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                                  **GREEDY)
        lp = with_lp.choices[0].logprobs
        n_prompt = len(prompt_ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 3
        assert "".join(lp.tokens[:n_prompt]) == prompt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first
        assert all(x < 0 for x in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
        assert lp.text_offset[n_prompt] == len(prompt)
        assert lp.text_offset == sorted(lp.text_offset)
        # the prompt's logprobs are the engine's prompt_logprobs
        out = [o async for o in engine.generate(prompt_ids, SamplingParams(max_tokens=1, prompt_logprobs=2))][-1]
        expected = [d[t] for t, d in zip(prompt_ids[1:], out.prompt_logprobs[1:], strict=True)]
        assert lp.token_logprobs[1:n_prompt] == pytest.approx(expected)
        # streamed: the first chunk of each choice leads with the prompt
        stream = await client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                                 stream=True, **GREEDY)
        chunks = [c.choices[0] async for c in stream if c.choices]
        assert chunks[0].text.startswith(prompt)
        assert "".join(c.text for c in chunks) == with_lp.choices[0].text
        assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
        assert [o for c in chunks for o in c.logprobs.text_offset] == lp.text_offset
        # max_tokens 0 with echo: the prompt alone, as OpenAI answers it (to score a text)
        score = await client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
        assert score.choices[0].text == prompt and score.choices[0].finish_reason == "length"
        assert len(score.choices[0].logprobs.tokens) == n_prompt and score.usage.completion_tokens == 0


async def test_chat_echo_continues_the_assistants_last_message(engine):
    messages = [*CHAT, {"role": "assistant", "content": "Once upon a time"}]
    async with live_server(engine) as (client, base):
        extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True, **IGNORE_EOS}
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                                      extra_body=extra)
        continued = reply.choices[0].message.content
        assert continued.startswith("Once upon a time") and len(continued) > len("Once upon a time")
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                                      stream=True, extra_body=extra)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == continued
        # the prompt ends inside the assistant's message: no end of turn after it
        rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert rendered.endswith("Once upon a time")
        assert reply.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))
        status, body = await _post(base, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
        assert status == 400 and body["error"]["param"] == "continue_final_message"  # with add_generation_prompt


# ---- structured outputs: every spelling constrains -----------------------------------------------


_REGEX = r"(cat|dog)-[0-9]{2}"
_GBNF = 'root ::= "pet:" animal\nanimal ::= "cat" | "dog"'
_LARK = 'start: "pet:" animal\nanimal: "cat" | "dog"'
SPELLINGS = [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": _REGEX}, lambda t: re.fullmatch(_REGEX, t)),
    ({"guided_json": CHOICE_SCHEMA}, lambda t: _valid_pet(t)),
    ({"guided_json": json.dumps(CHOICE_SCHEMA)}, lambda t: _valid_pet(t)),
    ({"guided_grammar": _GBNF}, lambda t: t in ("pet:cat", "pet:dog")),
    ({"guided_grammar": _LARK}, lambda t: t in ("pet:cat", "pet:dog")),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"regex": _REGEX}}, lambda t: re.fullmatch(_REGEX, t)),
    ({"structured_outputs": {"json": CHOICE_SCHEMA, "disable_any_whitespace": True}}, lambda t: _valid_pet(t)),
    ({"structured_outputs": {"grammar": _GBNF}}, lambda t: t in ("pet:cat", "pet:dog")),
    # any object: a random model's keys may run to max_tokens, so only its start is certain
    ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith('{')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": CHOICE_SCHEMA}}},
     lambda t: _valid_pet(t)),
    ({"response_format": {"type": "json_object"}}, lambda t: t.startswith('{')),
]


def _valid_pet(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"pet", "age"} and value["pet"] in ("cat", "dog") and 0 <= value["age"] <= 9


@pytest.mark.parametrize("spelling, valid", SPELLINGS, ids=[json.dumps(s)[:40] for s, _ in SPELLINGS])
async def test_every_structured_spelling_constrains_chat_and_completions(engine, spelling, valid):
    async with live_server(engine) as (client, _):
        for create, kwargs in ((client.completions.create, {"prompt": "Pick:"}),
                               (client.chat.completions.create, {"messages": CHAT})):
            body = dict(spelling)
            if "response_format" in body and "messages" in kwargs:  # an argument of the SDK's chat
                kwargs = {**kwargs, "response_format": body.pop("response_format")}
            r = await create(model="tiny", n=3, max_tokens=40, temperature=1.0, seed=3, extra_body=body, **kwargs)
            texts = [c.text if hasattr(c, "text") else c.message.content for c in r.choices]
            assert all(valid(t) for t in texts), (spelling, texts)
            if "json_object" not in json.dumps(spelling):
                assert all(c.finish_reason == "stop" for c in r.choices)


async def test_two_ways_to_constrain_are_a_400_naming_them(engine):
    async with live_server(engine) as (_, base):
        cases = [
            ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "response_format", "guided_regex"),
            ({"guided_choice": ["a"], "guided_regex": "a+"}, "guided_regex", "guided_choice"),
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex, choice"),
            ({"structured_outputs": {}}, "structured_outputs", "none"),
            ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
             "structured_outputs.whitespace_pattern", "not supported"),
            ({"guided_json": "{not json"}, "guided_json", "not a JSON schema"),
            ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", "llguidance"),
        ]
        for path, base_body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
            for extra, param, text in cases:
                status, body = await _post(base, path, {**base_body, **extra, "max_tokens": 2})
                assert status == 400 and body["error"]["param"] == param and text in body["error"]["message"], body
        status, _ = await _post(base, "/v1/completions", {"prompt": "x", "guided_regex": "a", "max_tokens": 2,
                                                          "guided_decoding_backend": "guidance"})
        assert status == 200


# ---- the field table: refused fields are 400s naming them ----------------------------------------


def test_the_table_lists_exactly_the_fields_each_request_struct_reads():
    for endpoint, struct in (("chat", ChatCompletionRequest), ("completions", CompletionRequest)):
        assert fields.implemented(endpoint) == set(struct.__struct_fields__), endpoint


def test_docs_print_the_table():
    docs = (Path(__file__).parent.parent / "docs" / "server.md").read_text()
    assert fields.markdown_table() in docs


async def test_every_refused_field_is_a_400_naming_it_and_its_inert_values_pass(engine):
    async with live_server(engine) as (_, base):
        common = {"priority": 0, "best_of": 1, "spaces_between_special_tokens": True, "bad_words": [],
                  "x_unknown_field": [1]}
        for endpoint, path, base_body, defaults in (
            ("chat", "/v1/chat/completions", {"messages": CHAT},
             {**common, "store": False, "service_tier": "auto", "modalities": ["text"], "include_reasoning": True}),
            ("completions", "/v1/completions", {"prompt": "Hi"}, {**common, "suffix": ""}),
        ):
            refused = [r.name for r in fields.RULES if isinstance(r.status(endpoint), fields.Refused)]
            assert len(refused) > 30
            for name in refused:
                status, body = await _post(base, path, {**base_body, name: {"asks": "something"}, "max_tokens": 1})
                assert status == 400, (endpoint, name, body)
                assert body["error"]["param"] == name and body["error"]["code"] == "unsupported_parameter"
            # null asks for nothing, as do the defaults clients send unasked; unknown fields pass unread
            inert = {name: None for name in refused} | defaults
            status, body = await _post(base, path, {**base_body, **inert, "max_tokens": 1})
            assert status == 200, (endpoint, body)
        status, body = await _post(base, "/v1/chat/completions", {"messages": CHAT, "prompt": "x"})
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = await _post(base, "/v1/completions", {"prompt": "x", "messages": CHAT})
        assert status == 400 and body["error"]["param"] == "messages"
        status, body = await _post(base, "/v1/chat/completions", {"messages": CHAT, "stream": True,
                                                                  "stream_options": {"include_obfuscation": True}})
        assert status == 400 and body["error"]["param"] == "stream_options.include_obfuscation"


async def test_the_openai_client_sees_refusals_by_name(engine):
    async with live_server(engine) as (client, _):
        cases = [
            (client.completions.create, {"prompt": "x", "suffix": "end"}, "suffix"),
            (client.completions.create, {"prompt": "x", "best_of": 3}, "best_of"),
            (client.chat.completions.create, {"messages": CHAT, "store": True}, "store"),
            (client.chat.completions.create, {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"},
                                              "modalities": ["text", "audio"]}, "audio"),
            (client.chat.completions.create, {"messages": CHAT, "extra_body": {"logits_processors": ["x"]}},
             "logits_processors"),
        ]
        for create, kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as info:
                await create(model="tiny", max_tokens=2, **kwargs)
            assert info.value.param == param and info.value.code == "unsupported_parameter", info.value.body


# ---- vLLM's other fields -------------------------------------------------------------------------


async def test_stop_reason_names_the_stop_string_or_token(engine):
    async with live_server(engine) as (client, _):
        greedy = await client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, logprobs=0,
                                                 temperature=0, extra_body={**IGNORE_EOS,
                                                                            "return_tokens_as_token_ids": True})
        tokens = greedy.choices[0].logprobs.tokens
        assert all(t.startswith("token_id:") for t in tokens)
        assert greedy.choices[0].stop_reason is None and greedy.choices[0].finish_reason == "length"
        stop_id = int(tokens[3].removeprefix("token_id:"))
        by_id = await client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8,
                                                 temperature=0, extra_body={**IGNORE_EOS, "stop_token_ids": [stop_id]})
        assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].stop_reason == stop_id
        chat = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                    extra_body=IGNORE_EOS)
        assert chat.choices[0].stop_reason is None
        text = chat.choices[0].message.content
        stop = text[len(text) // 2:][:3]
        by_text = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                       stop=["\u2603never", stop], extra_body=IGNORE_EOS)
        choice = by_text.choices[0]
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        assert choice.message.content == text[:text.index(stop)]
        stream = await client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8,
                                                 temperature=0, stream=True,
                                                 extra_body={**IGNORE_EOS, "stop_token_ids": [stop_id]})
        last = [c.choices[0] async for c in stream if c.choices][-1]
        assert last.finish_reason == "stop" and last.stop_reason == stop_id


async def test_prompt_logprobs_in_vllms_shapes(engine):
    prompt = "The quick brown fox"
    ids = engine.tokenizer.encode(prompt)
    async with live_server(engine) as (client, base):
        r = await client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=1,
                                            extra_body={"prompt_logprobs": 2})
        for choice in r.choices:
            entries = choice.prompt_logprobs
            assert len(entries) == len(ids) and entries[0] is None
            for token, entry in zip(ids[1:], entries[1:], strict=True):
                assert str(token) in entry and 2 <= len(entry) <= 3
                ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
                assert ranks == [1, 2]
                assert entry[str(token)]["decoded_token"] == engine.tokenizer.decode([token])
        status, body = await _post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                                  "prompt_logprobs": 0})
        assert status == 200 and body["prompt_logprobs"][0] is None
        assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
        assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])
        status, body = await _post(base, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 1, "stream": True})
        assert status == 400 and body["error"]["param"] == "prompt_logprobs"


async def test_beam_search_truncation_request_id_and_cache_salt(engine):
    async with live_server(engine) as (client, base):
        beams = await client.completions.create(model="tiny", prompt="The cat", n=2, max_tokens=4,
                                                extra_body={"use_beam_search": True, **IGNORE_EOS})
        again = await client.completions.create(model="tiny", prompt="The cat", n=2, max_tokens=4,
                                                extra_body={"use_beam_search": True, **IGNORE_EOS})
        assert [c.text for c in beams.choices] == [c.text for c in again.choices]
        assert beams.choices[0].text != beams.choices[1].text
        for extra, param in (({"length_penalty": 0.5}, "length_penalty"), ({"best_of": 3}, "best_of"),
                             ({"use_beam_search": True, "best_of": 1, "n": 2}, "best_of")):
            status, body = await _post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2, **extra})
            assert status == 400 and body["error"]["param"] == param, body
        long = " ".join(["word"] * 20)
        kept = await client.completions.create(model="tiny", prompt=long, max_tokens=1, echo=True,
                                               extra_body={"truncate_prompt_tokens": 5})
        assert kept.usage.prompt_tokens == 5
        assert kept.choices[0].text.startswith(engine.tokenizer.decode(engine.tokenizer.encode(long)[-5:]))
        named = await client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"request_id": "r1"})
        assert named.id == "cmpl-r1"
        salted = [await client.completions.create(model="tiny", prompt=long * 3, max_tokens=1,
                                                  extra_body={"cache_salt": salt}) for salt in ("s1", "s1", "s2")]
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in salted]
        assert cached[1] > 0 and cached[2] == 0


async def test_chat_template_kwargs_and_documents_reach_the_template(engine, monkeypatch):
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ greeting | default('none') }}"
                "{% for d in documents or [] %} [{{ d['title'] }}]{% endfor %}")
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    async with live_server(engine) as (client, base):
        r = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                 extra_body={"chat_template_kwargs": {"greeting": " Ahoy"}})
        assert r.usage.prompt_tokens == len(engine.tokenizer.encode("Say something. Ahoy", add_special_tokens=False))
        r = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                 extra_body={"documents": [{"title": "Moby Dick", "text": "..."}]})
        assert r.usage.prompt_tokens == len(engine.tokenizer.encode("Say something.none [Moby Dick]",
                                                                    add_special_tokens=False))
        status, body = await _post(base, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"greeting": "!"}})
        assert engine.tokenizer.decode(body["tokens"]) == "Say something.!"
        status, body = await _post(base, "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs":
                                                                  {"tokenize": True}})
        assert status == 400 and body["error"]["param"] == "chat_template_kwargs"


async def test_add_special_tokens_decides_whether_the_tokenizer_adds_its_own(engine, monkeypatch):
    # SmolLM2's tokenizer adds nothing itself: this one is made to add a BOS, as Llama's does
    tokenizer = engine.tokenizer
    plain_encode, bos = tokenizer.encode, tokenizer.bos_token_id

    def encode_adding_bos(text, add_special_tokens=True, **kwargs):
        return ([bos] if add_special_tokens else []) + plain_encode(text, add_special_tokens=False, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode_adding_bos)
    # a template that writes no BOS itself (SmolLM2's starts with it, and a second is never added)
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    words = len(plain_encode("The cat sat", add_special_tokens=False))
    async with live_server(engine) as (client, _):
        counts = {}
        for endpoint, kwargs in (("completions", {"prompt": "The cat sat"}), ("chat", {"messages": CHAT})):
            create = client.completions.create if endpoint == "completions" else client.chat.completions.create
            for special in (None, True, False):
                extra = {} if special is None else {"add_special_tokens": special}
                r = await create(model="tiny", max_tokens=1, extra_body=extra, **kwargs)
                counts[endpoint, special] = r.usage.prompt_tokens
        assert counts["completions", None] == counts["completions", True] == words + 1  # the default: add
        assert counts["completions", False] == words
        assert counts["chat", None] == counts["chat", False] == counts["chat", True] - 1  # the default: the template's


async def test_continuous_usage_stats_put_usage_in_every_chunk(engine):
    async with live_server(engine) as (client, _):
        stream = await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"stream_options": {"include_usage": True,
                                                                                "continuous_usage_stats": True},
                                                             **IGNORE_EOS})
        usages = [c.usage async for c in stream]
        assert all(u is not None for u in usages)
        assert [u.completion_tokens for u in usages] == sorted(u.completion_tokens for u in usages)
        assert usages[-1].completion_tokens == 3


# ---- routes: tokenizer, version, models -----------------------------------------------------------


async def test_tokenize_and_detokenize_round_trip(engine):
    tok = engine.tokenizer
    async with live_server(engine) as (_, base):
        status, body = await _post(base, "/tokenize", {"prompt": "Hello world, again", "return_token_strs": True})
        assert status == 200 and body["tokens"] == tok.encode("Hello world, again")
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.stats()["max_model_len"]
        assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
        status, back = await _post(base, "/detokenize", {"tokens": body["tokens"]})
        assert status == 200 and back == {"prompt": "Hello world, again"}
        status, chat = await _post(base, "/tokenize", {"messages": CHAT})
        rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
        status, bare = await _post(base, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
        assert bare["count"] < chat["count"]
        for bad, param in (({"prompt": "x", "messages": CHAT}, "prompt"), ({}, "prompt"),
                           ({"prompt": "x", "chat_template": "{{ 1 }}"}, "chat_template")):
            status, body = await _post(base, "/tokenize", bad)
            assert status == 400 and body["error"]["param"] == param
        status, body = await _post(base, "/detokenize", {"tokens": [10**9]})
        assert status == 400 and body["error"]["param"] == "tokens"
        async with aiohttp.ClientSession(base) as anonymous, anonymous.post("/tokenize", json={"prompt": "x"}) as r:
            assert r.status == 401  # behind the API key like every other route


async def test_version_and_models_retrieve(engine):
    async with live_server(engine) as (client, base):
        model = await client.models.retrieve("tiny")
        assert model.id == "tiny" and model.object == "model"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("org/other-model")
        assert missing.value.code == "model_not_found" and missing.value.body["type"] == "invalid_request_error"
        async with aiohttp.ClientSession(base, headers=AUTH) as http, http.get("/version") as resp:
            assert resp.status == 200 and await resp.json() == {"version": streamengine.__version__}


async def test_the_ray_ingress_engine_serves_the_same_routes(tiny_llama_dir, monkeypatch):
    """The Ray ingress runs this same app over a ClusterEngine: the routes must work with it."""
    pytest.importorskip("ray.serve")
    from aiohttp.test_utils import TestClient, TestServer

    from streamengine.ray.cluster_engine import ClusterEngine
    from streamengine.server import create_app

    engine = ClusterEngine(handle=_NoHandle(), app_name="t", config=EngineConfig(model=str(tiny_llama_dir)))
    monkeypatch.setattr(engine, "_refresh", _idle)  # no cluster to read replica loads from
    engine._loads = {"r0": {"stats": {"max_model_len": 1024}}}
    app = create_app(engine, ServerConfig(model_name="tiny", api_key=KEY))
    async with TestClient(TestServer(app)) as http:
        resp = await http.post("/tokenize", json={"prompt": "Hello world"}, headers=AUTH)
        body = await resp.json()
        assert body == {"count": 2, "max_model_len": 1024, "tokens": engine.tokenizer.encode("Hello world")}
        resp = await http.post("/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
        assert await resp.json() == {"prompt": "Hello world"}
        resp = await http.get("/version", headers=AUTH)
        assert await resp.json() == {"version": streamengine.__version__}
        resp = await http.get("/v1/models/tiny", headers=AUTH)
        assert (await resp.json())["max_model_len"] == 1024
        resp = await http.get("/v1/models/other", headers=AUTH)
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"


class _NoHandle:
    def options(self, **_):
        return self


async def _idle() -> None:
    import asyncio

    await asyncio.Event().wait()
