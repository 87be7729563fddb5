"""Constrained decoding keeps its promise: every sample of the default model at temperature 1.0
is valid, not just likely to be.

Each case of tests/structured_schemas.py (20 JSON schemas, regexes, choice lists) is sampled with
SmolLM2-135M-Instruct, n = 4, seeded. All requests are submitted at once so they share batches
(constrained rows of different grammars side by side, as in serving), then each output must have
ended because its grammar completed (finish_reason "stop", not "length"), parse with json.loads
and validate with the `jsonschema` package; regex outputs must re.fullmatch, choice outputs be
one of the choices.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from conftest import run_async
from structured_schemas import CHOICES, MAX_TOKENS, REGEXES, SCHEMAS

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.structured.params import Choice, JsonSchema, Regex

N = 4
CASES = {
    **{f"schema:{c.name}": (c.prompt, JsonSchema(schema=c.schema)) for c in SCHEMAS},
    **{f"regex:{c.name}": (c.prompt, Regex(pattern=c.pattern)) for c in REGEXES},
    **{f"choice:{c.name}": (c.prompt, Choice(choices=list(c.choices))) for c in CHOICES},
}


async def sample(engine: AsyncEngine, prompt: str, spec, seed: int) -> list[tuple[str, str]]:
    params = SamplingParams(temperature=1.0, n=N, seed=seed, max_tokens=MAX_TOKENS, structured=spec)
    chat = engine.apply_chat_template([{"role": "user", "content": prompt}])
    final = None
    async for out in engine.generate(chat, params):
        final = out
    return [(o.text, o.finish_reason) for o in final.outputs]


async def sample_all(smollm_dir) -> dict[str, list[tuple[str, str]]]:
    config = EngineConfig(model=str(smollm_dir), max_num_seqs=len(CASES) * N)
    async with AsyncEngine(config) as engine:
        results = await asyncio.gather(*(
            sample(engine, prompt, spec, seed) for seed, (prompt, spec) in enumerate(CASES.values())
        ))
    return dict(zip(CASES, results, strict=True))


@pytest.fixture(scope="module")
def outputs(smollm_dir) -> dict[str, list[tuple[str, str]]]:
    return run_async(sample_all(smollm_dir))


def test_twenty_schemas_and_every_kind_are_covered():
    assert len(SCHEMAS) == 20 and REGEXES and CHOICES
    text = json.dumps([c.schema for c in SCHEMAS])
    for keyword in ("required", "enum", "minItems", "maxItems", "pattern", "minimum", "maximum", "null",
                    "const", "anyOf", "$ref", "boolean", "prefixItems"):
        assert f'"{keyword}"' in text, keyword
    for case in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(case.schema)  # the cases themselves are sound


@pytest.mark.parametrize("case", SCHEMAS, ids=lambda c: c.name)
def test_json_schema_outputs_validate(outputs, case):
    samples = outputs[f"schema:{case.name}"]
    assert len(samples) == N
    for text, finish_reason in samples:
        assert finish_reason == "stop", (finish_reason, text)
        jsonschema.validate(json.loads(text), case.schema)


@pytest.mark.parametrize("case", REGEXES, ids=lambda c: c.name)
def test_regex_outputs_fullmatch(outputs, case):
    samples = outputs[f"regex:{case.name}"]
    assert len(samples) == N
    for text, finish_reason in samples:
        assert finish_reason == "stop", (finish_reason, text)
        assert re.fullmatch(case.pattern, text), text


@pytest.mark.parametrize("case", CHOICES, ids=lambda c: c.name)
def test_choice_outputs_are_one_of_the_choices(outputs, case):
    samples = outputs[f"choice:{case.name}"]
    assert len(samples) == N
    for text, finish_reason in samples:
        assert finish_reason == "stop", (finish_reason, text)
        assert text in case.choices, text


def test_samples_differ(outputs):
    """Temperature 1.0 really sampled: the 4 samples of a free-form case are not all one text
    (a mask that left only one token per step would pass every validity check above)."""
    varied = [key for key, samples in outputs.items() if len({t for t, _ in samples}) > 1]
    assert len(varied) >= len(outputs) // 2, varied
