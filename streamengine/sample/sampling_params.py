"""SamplingParams: how to pick the tokens of one request, as a validated msgspec Struct.

No torch and no numpy here: the server validates a client's message with this module alone.
Each range is written once, as a msgspec `Meta` on the field's annotation. msgspec enforces it
on decode and convert; `__post_init__` enforces the same annotation on direct construction,
through the rules `_rules` reads back from the type (msgspec.inspect).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from streamengine.errors import LimitExceededError
from streamengine.sample.stop_strings import StopAutomaton, build_automaton
from streamengine.structured.params import StructuredOutput, as_structured

MAX_N = 128
MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = 32
# Bounds on the work one request's stop conditions can ask for: the automaton of the
# stop strings has at most MAX_STOP_STRINGS * MAX_STOP_STRING_CHARS nodes.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # token ids a request may bias (OpenAI's own limit is lower)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token in practice, 100 all but forces it
GREEDY_EPS = 1e-5
"""Temperatures below this are greedy: dividing by them would only amplify float noise."""
# The range torch.Generator.manual_seed accepts; msgspec's Meta takes only int64 bounds.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1

_Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


def _limited(lower: int, maximum: int, limit: str) -> Meta:
    """[lower, maximum], where going past the maximum is a LimitExceededError named `limit`."""
    return Meta(ge=lower, le=maximum, extra={"limit": limit})


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, dict=True):
    """How to pick the tokens of one request (names and ranges follow vLLM / OpenAI).

    Validated on construction and on `msgspec.convert` / `msgspec.json.decode`; a bad value
    raises ValueError naming the field, and a value past one of the bounds below (MAX_N,
    MAX_BEAM_WIDTH, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS) raises its
    subclass LimitExceededError, whose `limit` is the bound's name in lower case ("max_n").
    `from_dict` gives these errors in the same words whatever the entry point found; msgspec's
    own entry points word a broken `Meta` range their way ("Expected `int` >= 1 - at `$.n`").
    `stop` may be given as one string. `seed` may be any integer torch accepts,
    -2**63 .. 2**64-1 (negative seeds are mapped to 64 bits by torch). `dict=True` leaves room
    for the cached stop automaton, which is not a field: never encoded nor compared.

    `structured` (a spec of structured/params.py, or the same as a dict with its "type")
    constrains every sample, or every beam, to the spec: each step only the tokens the grammar
    allows can be drawn, and logprobs are of that masked distribution. A sample ends with
    finish_reason "stop" as soon as its grammar is complete and allows nothing but the end of
    sequence, or when it draws that end of sequence in a state where the grammar may end; this
    holds whatever `min_tokens` and `ignore_eos` say (a finished grammar has nothing left to
    add). Stop strings, stop token ids and `max_tokens` still end it early ("length" for
    `max_tokens`), leaving an incomplete output. A spec that does not compile is a GrammarError.

    `prompt_logprobs` asks for the log-probabilities of the prompt's own tokens, each with its
    position's top `prompt_logprobs` alternatives (RequestOutput.prompt_logprobs). They are
    computed once per request, whatever `n` or `beam_width`.
    """

    n: Annotated[int, _limited(1, MAX_N, "max_n")] = 1
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0  # 0 = greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0  # 0 or -1 = off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0  # HF semantics, prompt and output
    presence_penalty: _Penalty = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: _Penalty = 0.0
    seed: int | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16  # None = until the context is full
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop: str | list[str] = []
    stop_token_ids: list[int] = []
    # Added to each listed token's logit before sampling (OpenAI's logit_bias), in
    # [-100, 100]; logprobs are of the logits before it.
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    # top logprobs per token; 0 = only the sampled token's
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # top logprobs per prompt position (vLLM's prompt_logprobs); 0 = only the prompt token's.
    # The request then computes its whole prompt: it takes no prefix-cache hits.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Beam search (beam_width > 1): deterministic; returns the n best finished beams.
    beam_width: Annotated[int, _limited(1, MAX_BEAM_WIDTH, "max_beam_width")] = 1
    length_penalty: float = 1.0  # score = sum of logprobs / generated_len ** length_penalty
    early_stopping: bool = False  # stop once beam_width hypotheses are finished
    # What each output of the request's stream carries: everything so far, or only what is new
    # since the previous output (vLLM's RequestOutputKind).
    output_kind: Literal["cumulative", "delta"] = "cumulative"
    # False: this request never uses speculative decoding (EngineConfig.speculative), whose
    # outputs are the same; greedy requests without penalties, biases, min_tokens, logprobs
    # or a grammar use it, others decode as without it.
    speculate: bool = True
    # Constrained decoding: the output must match this spec (structured/params.py).
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # msgspec checks the annotations on decode but not on direct construction: check them
        # here too, so `SamplingParams(n="3")` fails with the field's name, not deep in the sampler.
        for rule in _RULES:
            setattr(self, rule.name, rule.check(getattr(self, rule.name)))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_seed_and_lengths()
        self._check_beam()
        self._check_stop()
        self._check_stop_token_ids()
        self._check_logit_bias()
        if self.structured is not None:
            self.structured = as_structured(self.structured)  # a dict is converted here

    def _check_seed_and_lengths(self) -> None:
        if self.seed is not None:
            _check(
                _SEED_MIN <= self.seed <= _SEED_MAX,
                "seed",
                f"must be in [-2**63, 2**64-1], got {self.seed}",
            )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )

    def _check_beam(self) -> None:
        if self.beam_width == 1:
            return
        _check(self.n <= self.beam_width, "n", f"must be <= beam_width ({self.beam_width}) with beam search")
        _check(not self.stop, "stop", "stop strings are not supported with beam search")
        _check(self.logprobs is None, "logprobs", "logprobs are not supported with beam search")
        _check(not self.logit_bias, "logit_bias", "logit_bias is not supported with beam search")

    def _check_stop(self) -> None:
        _check(
            isinstance(self.stop, list),
            "stop",
            f"must be a string or a list of strings, got {self.stop!r}",
        )
        # Counted before any string is looked at: the checks themselves stay bounded.
        _check_limit(
            len(self.stop) <= MAX_STOP_STRINGS,
            "max_stop_strings",
            "stop",
            f"has {len(self.stop)} strings, more than the maximum of {MAX_STOP_STRINGS}",
        )
        for i, s in enumerate(self.stop):
            _check(
                isinstance(s, str) and s != "", "stop", f"must hold non-empty strings, got {s!r}"
            )
            _check_limit(
                len(s) <= MAX_STOP_STRING_CHARS,
                "max_stop_string_chars",
                f"stop[{i}]",
                f"has {len(s)} characters, more than the maximum of {MAX_STOP_STRING_CHARS}",
            )

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        _check(isinstance(bias, dict), "logit_bias", f"must map token ids to numbers, got {bias!r}")
        _check_limit(
            len(bias) <= MAX_LOGIT_BIAS,
            "max_logit_bias",
            "logit_bias",
            f"has {len(bias)} token ids, more than the maximum of {MAX_LOGIT_BIAS}",
        )
        for t, value in bias.items():
            _check(_is_int(t) and t >= 0, "logit_bias", f"must have token ids >= 0 as keys, got {t!r}")
            _check(
                isinstance(value, int | float) and not isinstance(value, bool)
                and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE,
                "logit_bias",
                f"must map to numbers in [-100, 100], got {value!r} for token {t}",
            )

    def _check_stop_token_ids(self) -> None:
        ids = self.stop_token_ids
        _check(isinstance(ids, list), "stop_token_ids", f"must be a list of ints, got {ids!r}")
        _check_limit(
            len(ids) <= MAX_STOP_TOKEN_IDS,
            "max_stop_token_ids",
            "stop_token_ids",
            f"has {len(ids)} ids, more than the maximum of {MAX_STOP_TOKEN_IDS}",
        )
        for t in ids:
            _check(_is_int(t), "stop_token_ids", f"must be a list of ints, got {t!r} in it")
            _check(t >= 0, "stop_token_ids", f"must hold ids >= 0, got {t}")

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or too small to matter)."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self) -> SamplingParams:
        """A copy for the engine to keep (vLLM clones a request's params too): the caller may
        edit or reuse its own object while the request runs. Lists and dicts are copied; the stop
        automaton built so far is shared (read-only, and rebuilt if `stop` ever differs)."""
        twin = copy.copy(self)
        twin.stop = list(self.stop)
        twin.stop_token_ids = list(self.stop_token_ids)
        twin.logit_bias = dict(self.logit_bias) if self.logit_bias is not None else None
        cached = getattr(self, "_stop_automaton", None)
        if cached is not None:
            twin._stop_automaton = cached
        return twin

    def stop_automaton(self) -> StopAutomaton | None:
        """The automaton of `stop` (None without stop strings), built on first use and kept on
        this object: the n detokenizers of a request share one."""
        if not self.stop:
            return None
        stops = tuple(self.stop)
        cached: StopAutomaton | None = getattr(self, "_stop_automaton", None)
        if cached is None or cached.stops != stops:  # also rebuilt if `stop` was changed
            cached = build_automaton(stops)
            self._stop_automaton = cached
        return cached

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Convert a JSON-like mapping; any error is a ValueError naming the field (a
        LimitExceededError, with its `limit`, for a value past a bound)."""
        bias = data.get("logit_bias")
        if isinstance(bias, dict):  # JSON object keys are strings: OpenAI's are token ids as text
            data = {**data, "logit_bias": {_token_key(k): v for k, v in bias.items()}}
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise _as_value_error(exc, data) from None


def _token_key(key: Any) -> Any:
    """A logit_bias key written as decimal text ("50256") as its int; anything else as is, for
    the field's check to name."""
    return int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key


# ---------------------------------------------------------------- rules read from the annotations


@dataclass(frozen=True, slots=True)
class _Rule:
    """The type and range of one scalar field, as its annotation states them."""

    name: str
    kind: type  # int, float, bool, or str for a Literal
    optional: bool = False  # None is allowed too
    constraints: mi.IntType | mi.FloatType | None = None  # carries ge / gt / le / lt
    choices: tuple[str, ...] = ()
    limit: str | None = None  # the LimitExceededError past the upper bound

    def check(self, value: object) -> object:
        """`value` as the field holds it (ints widened to float); ValueError if it breaks the rule."""
        if value is None and self.optional:
            return None
        self._check_type(value)
        if self.choices:
            choices = ", ".join(map(repr, self.choices))
            _check(value in self.choices, self.name, f"must be one of {choices}, got {value!r}")
        if self.kind is float:
            value = float(value)
            _check(math.isfinite(value), self.name, f"must be finite, got {value}")
        if self.constraints is not None:
            self._check_range(value)
        return value

    def _check_type(self, value: object) -> None:
        if self.kind is float:
            ok = _is_int(value) or isinstance(value, float)
        elif self.kind is int:
            ok = _is_int(value)  # bool is an int subclass, but `n=True` is surely a mistake
        else:
            ok = isinstance(value, self.kind)
        names = {int: "an int", float: "a number", bool: "a bool", str: "a string"}
        _check(ok, self.name, f"must be {names[self.kind]}{self._or_none}, got {value!r}")

    def _check_range(self, value: Any) -> None:
        c = self.constraints
        low_ok = (c.ge is None or value >= c.ge) and (c.gt is None or value > c.gt)
        high_ok = (c.le is None or value <= c.le) and (c.lt is None or value < c.lt)
        if low_ok and high_ok:  # NaN fails both: every comparison with it is False
            return
        message = f"SamplingParams.{self.name} must be {self._range}{self._or_none}, got {value}"
        if low_ok and self.limit is not None:
            raise LimitExceededError(self.limit, message)
        raise ValueError(message)

    @property
    def _range(self) -> str:
        c = self.constraints
        low = f"[{c.ge}" if c.ge is not None else f"({c.gt}" if c.gt is not None else ""
        high = f"{c.le}]" if c.le is not None else f"{c.lt})" if c.lt is not None else ""
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"{'>=' if c.ge is not None else '>'} {low[1:]}"
        return f"{'<=' if c.le is not None else '<'} {high[:-1]}"

    @property
    def _or_none(self) -> str:
        return " or None" if self.optional else ""


def _rule(name: str, info: mi.Type) -> _Rule | None:
    """The rule of a field typed X, X | None or Annotated[X, Meta] for a scalar X; None for
    the fields checked by hand (lists, unions of several types)."""
    optional = False
    if isinstance(info, mi.UnionType):
        others = [t for t in info.types if not isinstance(t, mi.NoneType)]
        if len(others) != 1:
            return None
        optional, info = True, others[0]
    limit = None
    if isinstance(info, mi.Metadata):
        limit = (info.extra or {}).get("limit")
        info = info.type
    if isinstance(info, mi.IntType | mi.FloatType):
        kind = int if isinstance(info, mi.IntType) else float
        bounded = any(b is not None for b in (info.ge, info.gt, info.le, info.lt))
        return _Rule(name, kind, optional, info if bounded else None, limit=limit)
    if isinstance(info, mi.BoolType):
        return _Rule(name, bool, optional)
    if isinstance(info, mi.LiteralType):
        return _Rule(name, str, optional, choices=tuple(info.values))
    return None


def _rules(cls: type[msgspec.Struct]) -> tuple[_Rule, ...]:
    fields = mi.type_info(cls).fields
    return tuple(rule for f in fields if (rule := _rule(f.name, f.type)) is not None)


_RULES = _rules(SamplingParams)
_RULES_BY_NAME = {rule.name: rule for rule in _RULES}


# ---------------------------------------------------------------- errors


def _as_value_error(exc: msgspec.ValidationError, data: Mapping[str, Any]) -> ValueError:
    # What __post_init__ raised, msgspec wraps in a ValidationError and keeps as the cause:
    # handed on as itself, so a limit error still says which limit.
    if isinstance(exc.__cause__, ValueError):
        return exc.__cause__
    head, sep, path = str(exc).rpartition(" - at `$.")
    field = path.rstrip("`") if sep else ""
    rule = _RULES_BY_NAME.get(field)
    if rule is not None and isinstance(data, Mapping) and field in data:
        # msgspec found the field's annotation broken: say so in the words (and with the limit
        # error) direct construction gives.
        try:
            rule.check(data[field])
        except ValueError as mine:
            return mine
    return ValueError(_describe(str(exc), head, field))


def _describe(message: str, head: str, field: str) -> str:
    """Reword msgspec's "Expected `int`, got `str` - at `$.n`" as "SamplingParams.n: ..."."""
    if field:
        return f"SamplingParams.{field}: {head}"
    if "unknown field" in message:
        return f"SamplingParams: {message} (not a sampling parameter)"
    return f"SamplingParams: {message}"


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")


def _check_limit(ok: bool, limit: str, field: str, message: str) -> None:
    if not ok:
        raise LimitExceededError(limit, f"SamplingParams.{field} {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
