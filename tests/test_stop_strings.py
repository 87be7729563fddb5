"""The Aho-Corasick stop-string automaton, and the detokenizer that uses it, against naive
references (a character-level fake tokenizer: no model files needed)."""

from __future__ import annotations

import random
import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamengine.sample import detokenizer as detokenizer_module
from streamengine.sample import stop_strings
from streamengine.sample.detokenizer import IncrementalDetokenizer
from streamengine.sample.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from streamengine.sample.stop_strings import (
    ROOT,
    StopMatch,
    build_automaton,
    held_length,
    scan,
    step,
)

# ---------------------------------------------------------------- naive references


def naive_match(text: str, start: int, stops: list[str]) -> tuple[int, int] | None:
    """(start, list index) of the stop string that starts first among those ending after
    `start` (the earlier listed on a tie), by trying every stop at every position."""
    found = [
        (pos, i)
        for i, stop in enumerate(stops)
        for pos in range(len(text) - len(stop) + 1)
        if pos + len(stop) > start and text.startswith(stop, pos)
    ]
    return min(found) if found else None


def naive_held(text: str, stops: list[str]) -> int:
    """Longest suffix of `text` that is a proper prefix of some stop string."""
    return max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0
    )


class NaiveDetokenizer:
    """What IncrementalDetokenizer does with stop strings, on a tokenizer whose tokens decode
    independently (so the new text of a token is its piece)."""

    def __init__(self, pieces: list[str], params: SamplingParams) -> None:
        self.pieces, self.stops = pieces, list(params.stop)
        self.include, self.min_tokens = params.include_stop_str_in_output, params.min_tokens
        self.output_text, self.held, self.num_tokens = "", 0, 0
        self.finished, self.stop_str = False, None

    @property
    def text(self) -> str:
        if self.finished:
            return self.output_text
        return self.output_text[: len(self.output_text) - self.held]

    def add_tokens(self, token_ids: list[int]) -> str | None:
        for token in token_ids:
            self.num_tokens += 1
            piece = self.pieces[token]
            if not piece:
                continue
            start = len(self.output_text)
            self.output_text += piece
            match = naive_match(self.output_text, start, self.stops)
            if match is not None and self.num_tokens >= self.min_tokens:
                pos, index = match
                stop = self.stops[index]
                self.output_text = self.output_text[: pos + len(stop) if self.include else pos]
                self.finished, self.stop_str = True, stop
                return stop
            self.held = naive_held(self.output_text, self.stops)
        return None

    def finish(self) -> None:
        self.finished = True


class PieceTokenizer:
    """Token id i decodes to pieces[i]; an empty piece behaves like a skipped special token."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[t] for t in token_ids)


# ---------------------------------------------------------------- the automaton


def test_classic_example() -> None:
    stops = ["he", "she", "his", "hers"]
    automaton = build_automaton(stops)
    node, match = scan(automaton, ROOT, "ushers")
    # "she" (ends at 3, starts at 1) starts before "he" (2) and "hers" (2)
    assert match == StopMatch(1, 1) and stops[match.index] == "she"
    node, match = scan(automaton, ROOT, "xhi")
    assert match is None and held_length(automaton, node) == 2  # "hi" may become "his"


def test_tie_on_start_goes_to_the_earlier_listed() -> None:
    for stops, expected in (
        (["abc", "ab"], 0),
        (["ab", "abc"], 0),
        (["b", "abc", "ab"], 1),
        (["c", "b", "ab"], 2),
    ):
        _, match = scan(build_automaton(stops), ROOT, "xabc")
        assert match is not None and match.start == 1 and match.index == expected, stops
    _, match = scan(build_automaton(["a", "a"]), ROOT, "a")  # a repeated string: first position
    assert match == StopMatch(0, 0)


def test_match_starting_before_the_scanned_text() -> None:
    automaton = build_automaton(["hello"])
    node, match = scan(automaton, ROOT, "say hel")
    assert match is None and held_length(automaton, node) == 3
    node, match = scan(automaton, node, "lo!")
    assert match == StopMatch(-3, 0)


def test_full_stop_string_is_not_held() -> None:
    # "ab" matched in full is not a *proper* prefix; only "a"-like suffixes are held
    automaton = build_automaton(["ab", "bc"])
    node, _ = scan(automaton, ROOT, "xab")
    assert held_length(automaton, node) == 1  # "b" may become "bc"
    node, _ = scan(build_automaton(["ab"]), ROOT, "xab")
    assert held_length(build_automaton(["ab"]), node) == 0


stop_lists = st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(stops=stop_lists, chunks=st.lists(st.text("abcd", max_size=6), max_size=8))
def test_scan_matches_the_naive_reference(stops: list[str], chunks: list[str]) -> None:
    automaton = build_automaton(stops)
    node, text = ROOT, ""
    for chunk in chunks:
        start = len(text)
        text += chunk
        node, match = scan(automaton, node, chunk)
        got = None if match is None else (start + match.start, match.index)
        assert got == naive_match(text, start, stops)
        assert held_length(automaton, node) == naive_held(text, stops)


# ---------------------------------------------------------------- the detokenizer

PIECES = ["a", "b", "c", "ab", "ba", "cab", "", " ", "abc"]


@settings(max_examples=300, deadline=None)
@given(
    stops=stop_lists,
    prompt=st.lists(st.integers(0, len(PIECES) - 1), max_size=6),
    tokens=st.lists(st.integers(0, len(PIECES) - 1), max_size=25),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    min_tokens=st.integers(0, 6),
    include=st.booleans(),
)
def test_detokenizer_matches_the_naive_reference(
    stops: list[str],
    prompt: list[int],
    tokens: list[int],
    chunks: list[int],
    min_tokens: int,
    include: bool,
) -> None:
    params = SamplingParams(
        stop=stops, min_tokens=min_tokens, include_stop_str_in_output=include, max_tokens=None
    )
    detok = IncrementalDetokenizer(PieceTokenizer(PIECES), prompt, params)
    naive = NaiveDetokenizer(PIECES, params)
    i = 0
    while i < len(tokens) and not naive.finished:
        size = chunks[i % len(chunks)]
        batch = tokens[i : i + size]
        i += size
        assert detok.add_tokens(batch) == naive.add_tokens(batch)
        state = (detok.text, detok.output_text, detok.finished, detok.stop_str)
        assert state == (naive.text, naive.output_text, naive.finished, naive.stop_str)
    detok.finish()
    naive.finish()
    assert (detok.text, detok.output_text) == (naive.text, naive.output_text)


def test_samples_share_one_automaton() -> None:
    params = SamplingParams(stop=["x", "yz"], n=4)
    tokenizer = PieceTokenizer(PIECES)
    detoks = [IncrementalDetokenizer(tokenizer, [], params) for _ in range(params.n)]
    assert len({id(d._automaton) for d in detoks}) == 1
    # the cache is not part of the params: equal, encoded alike
    assert params == SamplingParams(stop=["x", "yz"], n=4)
    assert msgspec.json.encode(params) == msgspec.json.encode(SamplingParams(stop=["x", "yz"], n=4))
    params.stop.append("w")  # changed in place: a fresh automaton, never a stale one
    assert params.stop_automaton() is not detoks[0]._automaton
    assert params.stop_automaton().stops == ("x", "yz", "w")
    assert SamplingParams().stop_automaton() is None


# ---------------------------------------------------------------- work per character


class CountingDict(dict):
    """A trie node's children that count the lookups the automaton makes in them."""

    lookups = 0

    def get(self, key, default=None):
        CountingDict.lookups += 1
        return super().get(key, default)


def lookups_per_char(stops: list[str], text: str) -> float:
    automaton = build_automaton(stops)
    counted = stop_strings.StopAutomaton(
        automaton.stops,
        tuple(CountingDict(c) for c in automaton.children),
        automaton.fail,
        automaton.match_len,
        automaton.match_index,
        automaton.held,
    )
    CountingDict.lookups = 0
    node = ROOT
    for ch in text:
        node = step(counted, node, ch)
    return CountingDict.lookups / len(text)


def test_automaton_steps_do_not_grow_with_the_stop_strings() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("ab") for _ in range(5000))
    for count, length in ((1, 2), (1, 256), (32, 256), (2000, 64)):
        # strings over the text's alphabet: deep partial matches, many failure links taken
        stops = ["".join(rng.choice("ab") for _ in range(length)) for _ in range(count)]
        per_char = lookups_per_char(stops, text)
        # one lookup per character plus one per failure link, and there are no more failure
        # links taken than characters read
        assert per_char <= 2.0, (count, length, per_char)


def traced_lines(params: SamplingParams, token_ids: list[int]) -> int:
    """Lines of the detokenizer and automaton modules run by add_tokens (an operation count)."""
    files = {detokenizer_module.__file__, stop_strings.__file__}
    detok = IncrementalDetokenizer(PieceTokenizer(PIECES), [], params)
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename not in files:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        for token in token_ids:
            detok.add_tokens([token])
    finally:
        sys.settrace(None)
    assert not detok.finished
    return count


@pytest.mark.skipif(sys.gettrace() is not None, reason="another tracer (coverage, debugger) is on")
def test_work_per_token_does_not_grow_with_the_stop_strings() -> None:
    rng = random.Random(1)
    tokens = [rng.choice([0, 1, 3, 4]) for _ in range(400)]  # "a", "b", "ab", "ba"

    def stops(count: int, length: int) -> list[str]:
        # partial matches all along the stream, a full one never ("c" does not occur)
        return ["".join(rng.choice("ab") for _ in range(length - 1)) + "c" for _ in range(count)]

    small = traced_lines(SamplingParams(stop=stops(1, 2), max_tokens=None), tokens)
    large = traced_lines(
        SamplingParams(stop=stops(MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS), max_tokens=None),
        tokens,
    )
    # before the automaton, every stop string and every prefix length was tried per token:
    # ~8,000 checks per token here
    assert large <= 2 * small, (small / len(tokens), large / len(tokens))
