"""SamplingParams validation and the batched sampler (CPU, small vocabularies, seeded)."""

from __future__ import annotations

import math
import subprocess
import sys

import msgspec
import msgspec.inspect
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamengine.errors import LimitExceededError
from streamengine.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    _filter_threshold,
    apply_penalties,
    greedy_tokens,
    sample_generator,
)
from streamengine.sample.sampling_params import (
    MAX_BEAM_WIDTH,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

# ---------------------------------------------------------------- SamplingParams validation

BAD_VALUES = [
    ("n", 0),
    ("n", 129),
    ("temperature", -1.0),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 3.0),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("stop", [""]),
    ("stop", ""),
    ("stop_token_ids", [-1]),
    ("logprobs", -1),
    ("logprobs", 21),
    ("output_kind", "full"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_direct_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [(f, v) for f, v in BAD_VALUES if not (isinstance(v, float) and not math.isfinite(v))],
)
def test_bad_value_decoded_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams.from_dict({field: value})
    # msgspec's own entry points validate too (ValidationError is a ValueError); a broken
    # `Meta` range is worded by msgspec, which names the field as a path
    names_field = rf"SamplingParams\.{field}\b|`\$\.{field}\b"
    with pytest.raises(ValueError, match=names_field):
        msgspec.json.decode(msgspec.json.encode({field: value}), type=SamplingParams)
    with pytest.raises(ValueError, match=names_field):
        msgspec.convert({field: value}, SamplingParams)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b'{"n": "3"}', "n"),
        (b'{"n": true}', "n"),
        (b'{"temperature": "hot"}', "temperature"),
        (b'{"stop": [1]}', "stop"),
        (b'{"max_tokens": 1.5}', "max_tokens"),
        (b'{"stop_token_ids": "x"}', "stop_token_ids"),
    ],
)
def test_wrong_type_in_json_names_field(payload: bytes, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b") as info:
        SamplingParams.from_dict(msgspec.json.decode(payload))  # as the servers do
    assert type(info.value) is ValueError  # plain ValueError, not msgspec's subclass


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", "3"),
        ("n", True),
        ("temperature", "1"),
        ("seed", 1.5),
        ("ignore_eos", 1),
        ("output_kind", 1),
    ],
)
def test_wrong_type_direct_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_unknown_field_and_bad_json() -> None:
    with pytest.raises(ValueError, match="unknown field `best_of`"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(ValueError, match="unknown field `best_of`"):
        msgspec.json.decode(b'{"best_of": 2}', type=SamplingParams)
    with pytest.raises(msgspec.DecodeError):  # a ValueError
        msgspec.json.decode(b'{"n": ', type=SamplingParams)
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)  # type: ignore[call-arg]


# (limit name, field as the message names it, value just under, just over, the count over)
LIMITS = [
    ("max_n", "n", {"n": MAX_N}, {"n": MAX_N + 1}, MAX_N + 1, MAX_N),
    (
        "max_beam_width",
        "beam_width",
        {"beam_width": MAX_BEAM_WIDTH},
        {"beam_width": MAX_BEAM_WIDTH + 1},
        MAX_BEAM_WIDTH + 1,
        MAX_BEAM_WIDTH,
    ),
    (
        "max_stop_strings",
        "stop",
        {"stop": [f"stop{i}" for i in range(MAX_STOP_STRINGS)]},
        {"stop": [f"stop{i}" for i in range(MAX_STOP_STRINGS + 1)]},
        MAX_STOP_STRINGS + 1,
        MAX_STOP_STRINGS,
    ),
    (
        "max_stop_string_chars",
        "stop[1]",
        {"stop": ["ok", "x" * MAX_STOP_STRING_CHARS]},
        {"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]},
        MAX_STOP_STRING_CHARS + 1,
        MAX_STOP_STRING_CHARS,
    ),
    (
        "max_stop_string_chars",
        "stop[0]",
        {"stop": "é" * MAX_STOP_STRING_CHARS},  # characters, not bytes; one string is a list of one
        {"stop": "é" * (MAX_STOP_STRING_CHARS + 1)},
        MAX_STOP_STRING_CHARS + 1,
        MAX_STOP_STRING_CHARS,
    ),
    (
        "max_stop_token_ids",
        "stop_token_ids",
        {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
        {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
        MAX_STOP_TOKEN_IDS + 1,
        MAX_STOP_TOKEN_IDS,
    ),
]

MAKERS = {
    "direct": lambda fields: SamplingParams(**fields),
    "from_dict": SamplingParams.from_dict,  # what the servers call
    "json": lambda fields: SamplingParams.from_dict(msgspec.json.decode(msgspec.json.encode(fields))),
}


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
@pytest.mark.parametrize(
    ("limit", "field", "under", "over", "value", "maximum"),
    LIMITS,
    ids=[f"{limit}-{field}" for limit, field, *_ in LIMITS],
)
def test_limits(make, limit, field, under, over, value, maximum) -> None:
    make(under)  # at the bound: accepted
    with pytest.raises(LimitExceededError) as info:
        make(over)
    assert type(info.value) is LimitExceededError  # itself, not msgspec's ValidationError
    assert info.value.limit == limit
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{field} "), message
    assert str(value) in message and str(maximum) in message, message


def test_limits_through_msgspec_still_name_the_field() -> None:
    # msgspec's own entry points wrap the error in its ValidationError (still a ValueError)
    with pytest.raises(ValueError, match=r"SamplingParams\.stop has 33 strings"):
        msgspec.convert({"stop": ["s"] * 33}, SamplingParams)


def test_lower_bounds_are_not_limits() -> None:
    for fields in ({"n": 0}, {"beam_width": 0}, {"stop": [""]}, {"stop_token_ids": [-1]}):
        with pytest.raises(ValueError) as info:
            SamplingParams.from_dict(fields)
        assert not isinstance(info.value, LimitExceededError), fields


def test_min_tokens_must_not_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.logprobs) == (
        1,
        1.0,
        1.0,
        0,
        16,
        [],
        None,
    )
    assert not p.greedy and not p.has_penalties
    assert SamplingParams(temperature=0).greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(stop="###").stop == ["###"]
    decoded = msgspec.json.decode('{"stop": "###", "temperature": 0, "top_k": -1}', type=SamplingParams)
    assert decoded.stop == ["###"]
    assert SamplingParams(seed=-5).seed == -5
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert p.output_kind == "cumulative"
    assert SamplingParams.from_dict({"output_kind": "delta"}).output_kind == "delta"


def _meta_bounds() -> list[tuple[str, object]]:
    """(field, a value just past one of its bounds) for every bound stated as a msgspec Meta."""
    cases = []
    for f in msgspec.inspect.type_info(SamplingParams).fields:
        info = f.type
        if isinstance(info, msgspec.inspect.UnionType):
            info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
        info = getattr(info, "type", info)  # through Metadata
        if not isinstance(info, msgspec.inspect.IntType | msgspec.inspect.FloatType):
            continue
        step = 1 if isinstance(info, msgspec.inspect.IntType) else 1e-6
        for past in (
            None if info.ge is None else info.ge - step,
            info.gt,
            None if info.le is None else info.le + step,
            info.lt,
        ):
            if past is not None:
                cases.append((f.name, past))
    return cases


def test_every_meta_bound_holds_on_direct_construction_too() -> None:
    cases = _meta_bounds()
    assert {"n", "top_p", "beam_width", "logprobs", "max_tokens"} <= {name for name, _ in cases}
    for name, value in cases:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name}\b") as direct:
            SamplingParams(**{name: value})
        with pytest.raises(ValueError) as converted:
            SamplingParams.from_dict({name: value})
        # one rule, read from the annotation, words both
        assert (type(direct.value), str(direct.value)) == (type(converted.value), str(converted.value))


def test_importing_sampling_params_loads_no_torch() -> None:
    # The server validates client messages with this module: it must stay light to import.
    code = (
        "import sys, streamengine.sample.sampling_params; "
        "print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sample_generator_reproducible() -> None:
    assert sample_generator(SamplingParams(), 0, "cpu") is None
    for seed in (0, 7, -1, 2**64 - 1):
        a, b = (
            sample_generator(SamplingParams(seed=seed), 0, "cpu"),
            sample_generator(SamplingParams(seed=seed), 0, "cpu"),
        )
        assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_sample_generator_streams_are_seed_plus_index_wrapped() -> None:
    def draw(seed: int, index: int) -> torch.Tensor:
        return torch.rand(5, generator=sample_generator(SamplingParams(seed=seed), index, "cpu"))

    assert torch.equal(draw(7, 3), draw(10, 0))
    assert torch.equal(draw(2**64 - 1, 1), draw(0, 0))  # wrapped to 64 bits
    assert torch.equal(draw(-1, 0), draw(2**64 - 1, 0))  # as torch maps negative seeds
    assert not torch.equal(draw(7, 0), draw(7, 1))  # each sample its own stream


@given(
    st.builds(
        SamplingParams,
        n=st.integers(1, 128),
        temperature=st.floats(0, 10),
        top_p=st.floats(0.01, 1),
        top_k=st.integers(-1, 1000),
        seed=st.none() | st.integers(-(2**63), 2**64 - 1),
        stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
        logprobs=st.none() | st.integers(0, 20),
    )
)
def test_json_round_trip(params: SamplingParams) -> None:
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params


# ---------------------------------------------------------------- the sampler

VOCAB = 64


def row(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> SamplingRow:
    return SamplingRow(params, sample_generator(params, 0, "cpu"), prompt or [], output or [])


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_equals_argmax_and_leaves_logits_alone() -> None:
    logits = random_logits(8)
    before = logits.clone()
    out = Sampler()(logits, [row(SamplingParams(temperature=0))] * 8)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8
    # the slow path (logprobs requested) must agree with the fast path
    slow = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=0))] * 8)
    assert slow.token_ids == out.token_ids
    assert torch.equal(logits, before)


def test_greedy_ties_take_the_first_index_as_argmax() -> None:
    """transformers' greedy search takes argmax: on exact ties, the lowest token id."""
    logits = torch.zeros(4, 49152)
    logits[:, [100, 30000]] = 5.0  # rows 0-3 tie between 100 and 30000
    logits[1, 7] = 5.0  # a three-way tie, first at 7
    logits[2, 49151] = 6.0  # a clear maximum at the last column
    out = Sampler()(logits, [row(SamplingParams(temperature=0))] * 4)
    assert out.token_ids == [100, 7, 49151, 100] == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(16)
    rows = [row(SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = random_logits(6)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(seed=1),
        SamplingParams(temperature=0, logprobs=2),
    ] * 2
    out = Sampler()(logits, [row(p) for p in params])
    for i in (0, 2, 3, 5):
        assert out.token_ids[i] == int(logits[i].argmax())


def sample_counts(
    logit_row: list[float], params: SamplingParams, draws: int = 4000
) -> torch.Tensor:
    """How often each token is drawn: `draws` identical rows sharing one seeded generator."""
    logits = torch.tensor([logit_row]).repeat(draws, 1)
    rows = [SamplingRow(params, None, [], [])] * draws
    out = Sampler()(logits, rows, default_generator=torch.Generator().manual_seed(1234))
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logit_row))


PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOGITS = [math.log(p) for p in PROBS]


def support(counts: torch.Tensor) -> set[int]:
    return set(torch.nonzero(counts).flatten().tolist())


def test_plain_sampling_matches_distribution() -> None:
    counts = sample_counts(LOGITS, SamplingParams(), draws=20000)
    freq = counts.double() / counts.sum()
    assert torch.allclose(freq, torch.tensor(PROBS, dtype=torch.float64), atol=0.015)


def test_temperature_sharpens_distribution() -> None:
    counts = sample_counts(LOGITS, SamplingParams(temperature=0.5), draws=20000)
    sharpened = torch.tensor(PROBS, dtype=torch.float64) ** 2
    sharpened /= sharpened.sum()
    assert torch.allclose(counts.double() / counts.sum(), sharpened, atol=0.015)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=-1), {0, 1, 2, 3, 4, 5}),
        (SamplingParams(top_p=0.7), {0, 1, 2}),  # 0.4 + 0.25 < 0.7 <= 0.8
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # p >= 0.12
        (SamplingParams(top_k=2, top_p=0.99), {0, 1}),
        # top-p acts on the top-k survivors renormalized: 0.4/0.8 + 0.25/0.8 >= 0.7
        (SamplingParams(top_k=3, top_p=0.7), {0, 1}),
        (SamplingParams(top_p=0.95, min_p=0.2), {0, 1, 2, 3}),  # p >= 0.08
    ],
)
def test_filters_restrict_support(params: SamplingParams, allowed: set[int]) -> None:
    assert support(sample_counts(LOGITS, params)) == allowed


def test_top_p_renormalises_over_kept_tokens() -> None:
    counts = sample_counts(LOGITS, SamplingParams(top_p=0.6), draws=20000)  # keeps {0, 1}
    freq = counts.double() / counts.sum()
    assert abs(freq[0].item() - 0.4 / 0.65) < 0.015 and abs(freq[1].item() - 0.25 / 0.65) < 0.015


@pytest.mark.parametrize(
    "cases",
    [
        # with a top-p row, every row goes through the sorted (top-k + top-p) path
        [
            (SamplingParams(top_k=1), {0}),
            (SamplingParams(top_p=0.5), {0, 1}),
            (SamplingParams(min_p=0.5), {0, 1}),
            (SamplingParams(top_k=4), {0, 1, 2, 3}),
            (SamplingParams(), {0, 1, 2, 3, 4, 5}),
        ],
        # without one, the top-k path; unfiltered and min-p rows ride along
        [
            (SamplingParams(top_k=2), {0, 1}),
            (SamplingParams(), {0, 1, 2, 3, 4, 5}),
            (SamplingParams(min_p=0.5), {0, 1}),
            (SamplingParams(top_k=5, min_p=0.3), {0, 1, 2}),
        ],
        [
            (SamplingParams(min_p=0.6), {0, 1}),
            (SamplingParams(temperature=0.5), {0, 1, 2, 3, 4, 5}),
        ],
    ],
)
def test_filters_vary_per_row_in_one_batch(cases: list[tuple[SamplingParams, set[int]]]) -> None:
    draws = 600
    logits = torch.tensor([LOGITS]).repeat(len(cases) * draws, 1)
    rows = [SamplingRow(p, None, [], []) for p, _ in cases] * draws
    out = Sampler()(logits, rows, default_generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor(out.token_ids).view(draws, len(cases))
    for column, (_, allowed) in enumerate(cases):
        assert set(tokens[:, column].tolist()) == allowed


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=300), SamplingParams(top_k=700)],
)
def test_threshold_on_a_large_flat_vocab(params: SamplingParams) -> None:
    """The vectorized cut equals a sort-and-count reference where the nucleus is large."""
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(5))
    probs = logits.softmax(-1)
    threshold = _filter_threshold(probs, [params] * 3)
    assert threshold is not None
    for r in range(3):
        kept = int((probs[r] >= threshold[r]).sum())
        ranked = probs[r].double().sort(descending=True).values
        k = params.top_k or 4096
        top = ranked[:k] / ranked[:k].sum()
        mass_before = top.cumsum(0) - top
        assert kept == int((mass_before < params.top_p).sum())
        assert kept >= 50  # the case under test: far more than a handful of tokens


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalized = apply_penalties(logits, [row(params, prompt=[0, 4], output=[1, 3, 3])])
    # repetition over prompt+output {0, 1, 3, 4}: 2/2, -1*2, 3/2, 0*2; then presence/frequency
    # over the output: token 1 once (-0.5 - 0.25), token 3 twice (-0.5 - 0.5)
    expected = torch.tensor([[1.0, -2.0 - 0.75, 0.5, 1.5 - 1.0, 0.0, 1.0]])
    assert torch.allclose(penalized, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0]]))


def test_penalties_apply_only_to_their_rows() -> None:
    logits = random_logits(4, vocab=8)
    rows = [
        row(SamplingParams(), prompt=[1, 2], output=[3]),
        row(SamplingParams(presence_penalty=1.0), prompt=[1, 2], output=[3, 3]),
        row(SamplingParams(repetition_penalty=1.5), prompt=[5], output=[]),
        row(SamplingParams(frequency_penalty=-1.0), prompt=[], output=[7, 7, 7]),
    ]
    penalized = apply_penalties(logits, rows)
    expected = logits.clone()
    expected[1, 3] -= 1.0
    x = expected[2, 5].item()
    expected[2, 5] = x / 1.5 if x > 0 else x * 1.5
    expected[3, 7] += 3.0
    assert torch.allclose(penalized, expected)
    first = logits[:1]
    assert apply_penalties(first, rows[:1]) is first  # no penalties: no copy


def test_penalty_steers_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    plain = Sampler()(logits, [row(SamplingParams(temperature=0), output=[0, 0])])
    penalized = Sampler()(
        logits, [row(SamplingParams(temperature=0, frequency_penalty=1.0), output=[0, 0])]
    )
    assert (plain.token_ids, penalized.token_ids) == ([0], [1])


def run_steps(
    logits: torch.Tensor, rows: list[SamplingRow], steps: int, default_seed: int
) -> list[list[int]]:
    default = torch.Generator().manual_seed(default_seed)
    return [Sampler()(logits, rows, default).token_ids for _ in range(steps)]


def test_seeded_row_independent_of_batch_mates_and_order() -> None:
    target = SamplingParams(seed=42, temperature=0.9, top_k=20, top_p=0.9)
    logits = random_logits(5, vocab=VOCAB, seed=3)
    alone = [steps[0] for steps in run_steps(logits[:1], [row(target)], 6, default_seed=0)]
    mates = [
        SamplingParams(),  # unseeded: default generator
        SamplingParams(seed=7, top_k=3),
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(min_p=0.2, logprobs=3),
    ]
    for position in range(5):
        params = mates[:position] + [target] + mates[position:]
        batch_logits = torch.cat([logits[1 : position + 1], logits[:1], logits[position + 1 :]])
        rows = [row(p, prompt=[1, 2], output=[3]) if p is not target else row(p) for p in params]
        got = [
            steps[position]
            for steps in run_steps(batch_logits, rows, 6, default_seed=position + 100)
        ]
        assert got == alone, f"target at position {position}"
    assert len(set(alone)) > 1  # the row really samples (otherwise the test proves nothing)


def test_unseeded_rows_follow_default_generator() -> None:
    logits = random_logits(4)
    rows = [row(SamplingParams()) for _ in range(4)]
    assert run_steps(logits, rows, 3, default_seed=5) == run_steps(logits, rows, 3, default_seed=5)
    assert run_steps(logits, rows, 3, default_seed=5) != run_steps(logits, rows, 3, default_seed=6)


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(3)
    params = [
        SamplingParams(logprobs=5, temperature=0.3, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logprobs=0, seed=3),
    ]
    out = Sampler()(logits, [row(p, prompt=[0, 1, 2]) for p in params])
    reference = torch.log_softmax(logits, dim=-1)
    top5 = reference[0].topk(5).indices.tolist()
    first = out.logprobs[0]
    assert first is not None and set(first) == set(top5) | {out.token_ids[0]}
    assert list(first)[:5] == top5  # most likely first
    for token, value in first.items():
        assert value == pytest.approx(reference[0, token].item(), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2] == {
        out.token_ids[2]: pytest.approx(reference[2, out.token_ids[2]].item(), abs=1e-6)
    }


def test_shape_mismatch_is_value_error() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 4), [row(SamplingParams())])
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(4), [row(SamplingParams())])


def allowed_tokens(logit_row: torch.Tensor, p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """A plain, loop-based reference of the filters (with a little slack at the boundaries)."""
    values = (logit_row.double() / p.temperature).tolist()
    keep = set(range(len(values)))
    if 0 < p.top_k < len(values):
        kth = sorted(values, reverse=True)[p.top_k - 1]
        keep = {i for i in keep if values[i] >= kth - slack}
    total = sum(math.exp(values[i]) for i in keep)
    probs = {i: math.exp(values[i]) / total for i in keep}
    if p.top_p < 1:
        mass, kept = 0.0, set()
        for i in sorted(keep, key=lambda i: -probs[i]):
            if mass >= p.top_p + slack:
                break
            kept.add(i)
            mass += probs[i]
        keep = kept
    if p.min_p > 0:
        best = max(probs[i] for i in keep)
        keep = {i for i in keep if probs[i] >= p.min_p * best - slack}
    return keep


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    temperature=st.floats(0.05, 4),
    top_k=st.integers(-1, 12),
    top_p=st.floats(0.05, 1),
    min_p=st.floats(0, 0.9),
)
def test_sampled_token_within_reference_support(
    seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    params = SamplingParams(
        seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    logits = random_logits(1, vocab=12, seed=seed % 1000)
    allowed = allowed_tokens(logits[0], params)
    generator = sample_generator(params, 0, "cpu")
    for _ in range(20):
        token = Sampler()(logits, [SamplingRow(params, generator, [], [])]).token_ids[0]
        assert token in allowed


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_penalties_match_loop_reference(batch: int, seed: int, data: st.DataObject) -> None:
    vocab = 10
    logits = random_logits(batch, vocab=vocab, seed=seed)
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)
    rows = []
    for _ in range(batch):
        params = SamplingParams(
            repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            presence_penalty=data.draw(st.sampled_from([0.0, -0.5, 1.0])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 0.25, -2.0])),
        )
        rows.append(row(params, prompt=data.draw(tokens), output=data.draw(tokens)))
    expected = logits.clone()
    for b, r in enumerate(rows):
        p = r.params
        for t in set(r.prompt_token_ids + r.output_token_ids):
            x = expected[b, t].item()
            expected[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(r.output_token_ids):
            count = r.output_token_ids.count(t)
            expected[b, t] -= p.presence_penalty + p.frequency_penalty * count
    assert torch.allclose(apply_penalties(logits, rows), expected, atol=1e-5)


def test_greedy_tokens_are_torch_argmax_on_ties_nan_and_views() -> None:
    """The CPU path takes NumPy's argmax: same index as torch's, first on ties, first NaN."""
    scores = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    scores[1, [3, 700]] = 50.0  # a tie: the first index
    scores[2, [10, 20]] = float("nan")  # NaN wins, the first one
    scores[3] = 0.0  # all equal
    expected = torch.argmax(scores, dim=-1).tolist()
    assert expected[1:4] == [3, 10, 0]
    assert greedy_tokens(scores).tolist() == expected
    view = scores[:, 1::2]  # strided rows
    assert greedy_tokens(view).tolist() == torch.argmax(view, dim=-1).tolist()
    assert greedy_tokens(scores.double()).dtype == torch.int64


# -- logit_bias ----------------------------------------------------------------------------


def test_logit_bias_moves_the_draw_and_leaves_logprobs_and_logits_alone() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [5.0, 1.0, 0.0, -1.0]])
    original = logits.clone()
    banned = SamplingParams(temperature=0, logit_bias={0: -100.0}, logprobs=0)
    forced = SamplingParams(temperature=0.7, seed=3, logit_bias={3: 100.0})
    out = Sampler()(logits, [row(banned), row(forced)])
    assert out.token_ids == [1, 3]
    assert out.logprobs[0] == {1: pytest.approx(torch.log_softmax(original[0], -1)[1].item())}
    assert torch.equal(logits, original)
    # unbiased rows batched beside them draw as they would alone
    plain = SamplingParams(temperature=0)
    assert Sampler()(logits, [row(plain), row(banned)]).token_ids == [0, 1]


def test_logit_bias_is_validated() -> None:
    assert SamplingParams.from_dict({"logit_bias": {"7": 5}}).logit_bias == {7: 5.0}
    for bad, field in [({"5": 101}, "logit_bias"), ({"-1": 1}, "logit_bias"), ({"x": 1}, "logit_bias"),
                       ({5: True}, "logit_bias")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams.from_dict({"logit_bias": bad})
    with pytest.raises(LimitExceededError, match="logit_bias has 1025 token ids") as info:
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))
    assert info.value.limit == "max_logit_bias"
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(beam_width=2, logit_bias={1: 1.0})
