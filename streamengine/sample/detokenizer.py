"""Incremental detokenization with stop-string detection, one request at a time.

Decoding the whole output after every token costs O(length) per token. Instead each step
decodes a short window twice: the tokens already shown that precede the new ones ("prefix",
kept because tokenizers such as SentencePiece render a token's leading space only after
another token) and the same window plus the new tokens. The new text is the difference.
While the window decodes to a trailing U+FFFD, the new tokens end inside a multi-byte
character, so the text is held until the character completes.

Stop strings are found by an Aho-Corasick automaton (stop_strings.py) built once per request
and shared by its samples: each new character costs O(1) amortized, however many and however
long the stop strings are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from streamengine.sample.sampling_params import SamplingParams
from streamengine.sample.stop_strings import ROOT, StopAutomaton, held_length, scan

_PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens to decode in front of the first output token (see the module docstring)."""
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


Decode = Callable[[list[int], bool], str]
"""(token ids, skip special tokens) -> text, exactly as the tokenizer's `decode` renders it."""


def decode_function(tokenizer: Tokenizer) -> Decode:
    """The cheapest call that renders token ids exactly as `tokenizer.decode` does.

    transformers' fast tokenizers wrap a Rust `tokenizers.Tokenizer` in Python layers
    (argument conversion, batch detection, optional space clean-up) that cost more than the
    decode of a short window itself: two windows per request and step for 128 requests took
    0.95 ms through the wrapper, 0.35 ms straight through the backend. When the wrapper is
    transformers' own and would not clean up spaces, its result is the backend's, so the
    backend is called directly.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _renders_as_backend(tokenizer):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _renders_as_backend(tokenizer: Tokenizer) -> bool:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    cls = type(tokenizer)
    # A subclass that overrides decoding may post-process the backend's text.
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text and finds its stop strings.

    `output_text` is everything decoded so far; `text` is the part that may be shown now: it
    never shrinks, and until the request is finished it leaves out a tail that could still
    grow into a stop string. The caller decides which token ids to pass (for instance whether
    an EOS token is detokenized); with `skip_special_tokens` special tokens decode to nothing.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._decode_ids = decode_function(tokenizer)
        self._skip_special = params.skip_special_tokens
        # Shared with the request's other samples; this detokenizer keeps only its state.
        self._automaton: StopAutomaton | None = params.stop_automaton()
        self._stop_state = ROOT
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # The window: a few already-rendered ids, then the ids not yet rendered.
        self._ids = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""
        self._held = 0  # characters at the end of _text that may start a stop string
        self._num_output_tokens = 0
        self._finished = False
        self._stop_str: str | None = None

    @property
    def output_text(self) -> str:
        """All text decoded so far (truncated at a matched stop); final once finished."""
        return self._text

    @property
    def text(self) -> str:
        """The text that may be shown now; grows monotonically."""
        if self._finished or not self._held:
            return self._text
        return self._text[: len(self._text) - self._held]

    def text_since(self, offset: int) -> str:
        """`text[offset:]`: what became visible after the first `offset` characters, at a
        cost in the new characters only."""
        end = len(self._text) if self._finished else len(self._text) - self._held
        return self._text[offset:end] if end > offset else ""

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the request, if one did."""
        return self._stop_str

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append generated tokens; return the stop string they complete, else None.

        On a match the text is cut at the stop string (kept if `include_stop_str_in_output`),
        the request is finished, and tokens after the one completing the match are ignored.
        """
        if self._finished:
            raise RuntimeError("add_tokens() after the detokenizer finished")
        for token_id in token_ids:
            self._ids.append(token_id)
            self._num_output_tokens += 1
            new = self._decode_new()
            if not new:
                continue
            start = len(self._text)
            self._text += new
            if self._automaton is None:
                continue
            stop = self._match_stops(self._automaton, start, new)
            if stop is not None:
                return stop
        return None

    def finish(self) -> None:
        """End the request for a reason other than a stop string: release all held text."""
        if self._finished:
            return
        if self._read_offset < len(self._ids):
            # Tokens that never completed a character: show them as decode() would (U+FFFD).
            prefix, full = self._decode_window()
            self._text += full[len(prefix) :]
        self._finished = True

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt ending inside a character would make the first window's text shorter
        # than its prefix; decoding the output on its own is then the faithful choice.
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, self._skip_special)

    def _decode_window(self) -> tuple[str, str]:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return prefix, full

    def _decode_new(self) -> str:
        prefix, full = self._decode_window()
        if full.endswith(_REPLACEMENT_CHAR):
            return ""  # inside a multi-byte character: wait for its remaining bytes
        if len(full) <= len(prefix):
            # Nothing visible (a skipped special token): the prefix window stays as it was,
            # so later tokens keep their context, but the token counts as read.
            if full == prefix:
                self._read_offset = len(self._ids)
            return ""
        # The window slides: what was new is now the context of the next tokens. Dropping
        # ids before it keeps the list (and every decode) short.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _match_stops(self, automaton: StopAutomaton, start: int, new: str) -> str | None:
        """Read the text `new` added at `start`; end the request at the stop string that starts
        first among those ending in it (unless min_tokens are still to come)."""
        self._stop_state, match = scan(automaton, self._stop_state, new)
        if match is None or self._num_output_tokens < self._min_tokens:
            self._held = held_length(automaton, self._stop_state)
            return None
        stop = automaton.stops[match.index]
        pos = start + match.start
        self._text = self._text[: pos + len(stop) if self._include_stop else pos]
        self._held = 0
        self._finished = True
        self._stop_str = stop
        return stop
