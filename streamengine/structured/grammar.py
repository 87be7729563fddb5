"""Grammar-constrained decoding on llguidance: a spec's grammar text, and walking it.

`grammar_text` turns a spec of structured/params.py into llguidance's grammar, which
compiler.GrammarCompiler compiles into a `CompiledGrammar` (shared, cached); each
sample or beam then walks it with its own `GrammarMatcher`. Each step
mask.TokenMasker masks the logits of the constrained rows.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from streamengine.errors import GrammarError
from streamengine.structured.json_schema import normalize_schema
from streamengine.structured.mask import MaskAccount
from streamengine.structured.params import (
    JSON_LAYOUT,
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    StructuredOutput,
)


class GrammarMatcher:
    """Where one sample (or beam) stands in its grammar."""

    __slots__ = ("_ll", "account")

    def __init__(self, ll: llguidance.LLMatcher, account: MaskAccount | None = None) -> None:
        self._ll = ll
        self.account = account  # the request's mask time (structured/mask.py); forks share it

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of an int32 CPU bitmask."""
        llguidance.torch.fill_next_token_bitmask(self._ll, bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advances past `token_id`; GrammarError if the grammar refuses it. A masked draw is
        refused only when the grammar went past llguidance's limits on this step (a schema
        that no finite value matches, a lexer that outgrows its states), or when the request's
        mask went over its time budget (the draw was never masked): the spec's fault."""
        if self.account is not None and self.account.error is not None:
            raise GrammarError(self.account.error)
        if not self._ll.consume_token(token_id):
            raise GrammarError(
                f"the structured-output grammar gave out while decoding (token {token_id} refused): "
                f"{_llg_error(self._ll)}"
            )

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: the bytes only
        one continuation allows, tokenized), [] when none is forced or the grammar is complete."""
        return [] if self._ll.is_stopped() else list(self._ll.compute_ff_tokens())

    def try_accept(self, token_id: int) -> bool:
        """Advances past `token_id` if the grammar allows it; False (and no change) if not.
        For checking a draft on a fork, never on a sample's own matcher."""
        return self._ll.try_consume_tokens([token_id]) == 1

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (a beam forked from this one)."""
        return GrammarMatcher(self._ll.deep_copy(), self.account)

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

    def matcher(self, account: MaskAccount | None = None) -> GrammarMatcher:
        """A matcher at the start of the grammar, charging its masks to `account`."""
        return GrammarMatcher(self._prototype.deep_copy(), account)


def _llg_error(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error without the marker its short (non-verbose) errors end with."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


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
