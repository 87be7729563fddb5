"""Grammar-constrained decoding on llguidance: compiling specs, matchers, and the token mask.

The only module that imports llguidance. `GrammarCompiler` (one per engine) turns a spec of
structured_params.py into a `CompiledGrammar`, off the caller's thread, with a timeout and an
LRU cache; each sample or beam then walks the grammar with its own `GrammarMatcher`. Each step
`TokenMasker` fills one bitmask [rows, ceil(vocab / 32)] for the constrained rows (in parallel,
in Rust) and sets the logits of every token the grammar forbids to -inf.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from streamengine.errors import GrammarError
from streamengine.json_schema import normalize_schema
from streamengine.structured_params import (
    JSON_LAYOUT,
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    StructuredOutput,
    structured_key,
)

# Short errors: the verbose ones carry the parser's state and the whole grammar.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_COMPILE_THREADS = 2  # one hostile spec still compiling leaves room for the others


class GrammarMatcher:
    """Where one sample (or beam) stands in its grammar."""

    __slots__ = ("_ll",)

    def __init__(self, ll: llguidance.LLMatcher) -> None:
        self._ll = ll

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of an int32 CPU bitmask."""
        llguidance.torch.fill_next_token_bitmask(self._ll, bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advances past `token_id`; GrammarError if the grammar refuses it (a masked draw
        never is refused: this is a bug, and fails the request)."""
        if not self._ll.consume_token(token_id):
            raise GrammarError(f"token {token_id} is refused by the grammar: {self._ll.get_error()}")

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (a beam forked from this one)."""
        return GrammarMatcher(self._ll.deep_copy())

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: nothing but the end of sequence may follow."""
        return self._ll.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (it may still go on)."""
        return self._ll.is_accepting()


class CompiledGrammar:
    """An immutable compiled spec, shared by every request that uses it (cached)."""

    __slots__ = ("_prototype",)

    def __init__(self, prototype: llguidance.LLMatcher) -> None:
        self._prototype = prototype  # never advanced: only copied

    def matcher(self) -> GrammarMatcher:
        """A matcher at the start of the grammar."""
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarCompiler:
    """Compiles specs for one tokenizer with a `timeout_s` bound on how long a caller waits,
    keeping the last `cache_size` results. Failures are cached too (a known-bad spec fails
    fast). A compile past the timeout goes on in its thread (llguidance bounds its work) and
    caches what it finds, so the spec sent again does not start over."""

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float, cache_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, CompiledGrammar | str] = OrderedDict()  # str: the error
        self._lock = threading.Lock()  # the cache and the pool: held only briefly
        self._tokenizer_lock = threading.Lock()  # the slow one-time build, never on the loop
        self._lltok: llguidance.LLTokenizer | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Compiles `spec` (or takes it from the cache), waiting at most `timeout_s`."""
        key = structured_key(spec)
        cached = self._lookup(key)
        if cached is not None:
            return cached
        self._tokenizer()  # once per engine, outside the timeout: it bounds the spec's work only
        future = self._executor().submit(self._build_and_store, key, spec)
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # still queued: never starts; running: finishes and caches alone
            raise self._timeout_error() from None
        return _unwrap(result)

    async def compile_async(self, spec: StructuredOutput) -> CompiledGrammar:
        """`compile` without blocking the event loop: the compile runs in this compiler's
        threads; past `timeout_s` the caller gets GrammarError (the thread finishes alone)."""
        key = structured_key(spec)
        cached = self._lookup(key)
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        if self._lltok is None:  # once per engine, outside the timeout: it bounds the spec's work only
            await loop.run_in_executor(self._executor(), self._tokenizer)
        try:
            result = await asyncio.wait_for(
                loop.run_in_executor(self._executor(), self._build_and_store, key, spec), self.timeout_s
            )
        except TimeoutError:
            raise self._timeout_error() from None
        return _unwrap(result)

    def shutdown(self) -> None:
        """Stops the compile threads (a compile still running finishes on its own); a later
        compile starts new ones."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS, "streamengine-grammar")
            return self._pool

    def _timeout_error(self) -> GrammarError:
        return GrammarError(f"the structured-output spec did not compile within {self.timeout_s:g} s")

    def _lookup(self, key: bytes) -> CompiledGrammar | None:
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if isinstance(cached, str):
            raise GrammarError(cached)
        return cached

    def _build_and_store(self, key: bytes, spec: StructuredOutput) -> CompiledGrammar | str:
        """Compiles and caches the result, also when the caller stopped waiting: a spec sent
        again after its compile finished then hits the cache (grammar or error) at once."""
        result = self._build(spec)
        with self._lock:
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result

    def _build(self, spec: StructuredOutput) -> CompiledGrammar | str:
        """The compiled grammar, or why the spec does not compile (runs in a compile thread)."""
        try:
            grammar = grammar_text(spec)
        except (ValueError, GbnfToLarkError) as exc:
            return f"invalid structured-output spec: {exc}"
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=_LIMITS)
        if not matcher.is_error():
            # The first mask builds the lexer's first states: here, within the timeout and
            # for every copy, rather than in a decode step that the whole batch waits for;
            # a spec that exhausts llguidance's limits there fails now, as a bad spec.
            matcher.compute_bitmask()
        if matcher.is_error():
            return f"invalid structured-output spec: {matcher.get_error().strip()}"
        return CompiledGrammar(matcher)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use (it takes a while)."""
        with self._tokenizer_lock:
            if self._lltok is None:
                if len(self.tokenizer) > self.vocab_size:
                    raise GrammarError(
                        f"the model's logits ({self.vocab_size} tokens) are narrower than its tokenizer "
                        f"({len(self.tokenizer)} tokens): structured outputs cannot mask them"
                    )
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._lltok


def _unwrap(result: CompiledGrammar | str) -> CompiledGrammar:
    if isinstance(result, str):
        raise GrammarError(result)
    return result


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec` (its compile happens when a matcher is built)."""
    if isinstance(spec, JsonSchema):
        if spec.schema is False:
            raise ValueError("the JSON schema false allows no value")
        schema = spec.schema if isinstance(spec.schema, dict) else {}  # true: any value
        schema = normalize_schema(schema, strict=spec.strict is not False)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if isinstance(spec, JsonObject):
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if isinstance(spec, Regex):
        return llguidance.LLMatcher.grammar_from_regex(spec.pattern)
    if isinstance(spec, Choice):
        # Lark string literals take JSON's escapes, so any text is one literal.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choices)))
    if isinstance(spec, Grammar):
        lark = _gbnf_to_lark(spec.grammar) if spec.syntax == "ebnf" else spec.grammar
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise TypeError(f"not a structured-output spec: {spec!r}")


def _gbnf_to_lark(gbnf: str) -> str:
    """llguidance's GBNF converter with every failure a ValueError: it is plain Python and
    reports some bad grammars with a bare Exception ("Rule 'x' not found", "No 'root' rule
    found"), an IndexError (a trailing backslash) or a RecursionError (deep nesting), which
    would otherwise reach the client as a 500 rather than a 400 invalid_grammar."""
    try:
        return gbnf_to_lark(gbnf)
    except GbnfToLarkError:
        raise
    except Exception as exc:
        raise ValueError(f"the GBNF grammar does not convert: {type(exc).__name__}: {exc}") from None


class TokenMasker:
    """Sets the forbidden tokens' logits to -inf, for the rows that have a matcher.

    One per model runner: it owns llguidance's thread pool for filling many rows at once and
    a reusable host bitmask."""

    def __init__(self) -> None:
        self._executor: llguidance.LLExecutor | None = None
        self._bitmask: torch.Tensor | None = None  # int32 [capacity, words], CPU
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """`logits` [rows, vocab] float32 with every row that has a matcher masked: a new
        tensor, or `logits` itself when no row has one (it is never modified)."""
        constrained = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            return logits
        bitmask = self._fill(constrained, logits.shape[1])  # [R, words] int32: bit set = allowed
        rows = [i for _, i in constrained]
        if logits.device.type == "cpu" and sys.byteorder == "little":
            return _mask_on_host(logits, rows, bitmask)
        return self._mask_on_device(logits, rows, bitmask)

    def _mask_on_device(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        # Bit b of word w is token 32 w + b (llguidance's layout), unpacked without a loop.
        bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
        forbidden_tokens = bits.view(len(rows), -1)[:, :vocab] == 0  # [R, vocab]
        out = logits.clone()
        index = torch.tensor(rows, dtype=torch.long, device=device)
        out[index] = out[index].masked_fill_(forbidden_tokens, float("-inf"))
        return out

    def _fill(self, constrained: list[tuple[GrammarMatcher, int]], vocab: int) -> torch.Tensor:
        """The allowed tokens of each constrained row, as int32 [R, words] on the host."""
        rows, words = len(constrained), (vocab + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < rows or self._bitmask.shape[1] != words:
            self._bitmask = llguidance.torch.allocate_token_bitmask(max(rows, 8), vocab)
        bitmask = self._bitmask[:rows]  # the leading rows of a contiguous tensor: contiguous
        if rows == 1:
            constrained[0][0].fill_bitmask(bitmask, 0)
            return bitmask
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(m._ll, j) for j, (m, _) in enumerate(constrained)], bitmask
        )
        return bitmask


def _mask_on_host(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """The CPU form of the mask, in numpy: single-threaded and cheaper than torch's ops on
    tensors this small. On a little-endian host the int32 words, read as bytes with the low
    bit first, are the tokens in order."""
    vocab = logits.shape[1]
    out = logits.numpy().copy()  # [B, vocab] float32, contiguous
    forbidden = np.invert(bitmask.numpy()).view(np.uint8)  # [R, 4 * words]
    forbidden_tokens = np.unpackbits(forbidden, axis=1, count=vocab, bitorder="little")  # [R, vocab]
    for j, i in enumerate(rows):
        np.copyto(out[i], -np.inf, where=forbidden_tokens[j].view(bool))
    return torch.from_numpy(out)
