"""WebSocket protocol of `/v1/stream`: JSON messages as msgspec tagged unions (`"type"` field).

Client -> server: `auth`, `generate`, `abort`, `kv_state`.
Server -> client: `ready`, `delta`, `done`, `error`, `kv_state`.

Sampling parameters travel as a plain object and are converted into the engine's own
`SamplingParams`, so every knob the engine accepts is available here with its own validation
(structured outputs too: `params.structured`, e.g. `{"type": "json_schema", "schema": {...}}`).
`params.lora`, not a sampling parameter, names a loaded LoRA adapter to run the request under
(left out: the tenant's adapter, or the base model); an unknown one is `invalid_params`.
`generate` with `messages` may offer `tools` and a `tool_choice` as OpenAI's chat does
(server/tools.py); calls then come in `delta.tool_calls` as they are written (an entry with
`id` opens call `index` with its name, later entries add to its arguments), left out of
`delta.text`, and a sample whose calls are complete finishes with "tool_calls".
Request ids are at most `MAX_ID_CHARS` characters: errors echo them, so a long id must not be
able to multiply what the server holds for a client.

Every problem with one message or request is an `error` (codes below) and the socket stays
open. The socket itself is closed only with: 1001 (server shutting down), 1007 (a text frame
that is not UTF-8, refused by aiohttp), 1008 (the client reads too slowly even for merged
deltas), 1009 (a frame over 4x the message limit, refused by aiohttp), 4001 (unauthorized).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# Error codes sent in `error.code`; the WebSocket stays open after each of these.
BAD_JSON = "bad_json"  # not JSON (or not UTF-8)
TOO_DEEP = "too_deep"  # JSON nested deeper than the decoder goes (about 1,000 levels)
BAD_MESSAGE = "bad_message"  # JSON of the wrong shape (unknown type or field, id too long, ...)
BAD_PARAMS = "invalid_params"
INVALID_GRAMMAR = "invalid_grammar"  # a structured output that does not compile (or not in time)
DUPLICATE_ID = "duplicate_id"
UNKNOWN_ID = "unknown_id"
MESSAGE_TOO_LARGE = "message_too_large"  # over max_message_bytes, counted in UTF-8 bytes
PROMPT_TOO_LONG = "prompt_too_long"
TOO_MANY_REQUESTS = "too_many_requests"  # live requests on this socket
LIMIT_EXCEEDED = "limit_exceeded"  # an engine limit; `limit` names it
OVERLOADED = "overloaded"  # the engine's queue is full; retry after `retry_after` seconds
TIMEOUT = "timeout"  # the request ran past the server's request timeout and was aborted
SHUTTING_DOWN = "shutting_down"  # the server is draining: no new requests
FORBIDDEN = "forbidden"  # the tenant may not do this (kv_state needs an admin key)
AUTH_NOT_REQUIRED = "auth_not_required"  # an `auth` message to a server without keys
ENGINE_ERROR = "engine_error"  # the engine failed this request; `message` says how

# Close codes. 4001 is in the private range (4000-4999) that applications may define;
# 1008 (policy violation) closes a client that reads too slowly even for merged deltas.
CLOSE_UNAUTHORIZED = 4001
PROTOCOL_NAME = "streamengine.v1"
BEARER_PROTOCOL_PREFIX = "bearer."


MAX_ID_CHARS = 256
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
UserId = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call, as OpenAI's chat shows one: in an earlier message, or in a `delta`."""

    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None  # with the call's id, in the entry that opens it
    arguments: str  # arguments text written since the last entry of this call


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A part of call `index` of a sample (OpenAI's streamed shape): the entry with `id` (and
    `type`, `function.name`) opens the call, the others add to its `function.arguments`."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | None = None  # None only for an assistant message that made tool calls
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # role "tool": the call this is the result of


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionName
    type: Literal["function"] = "function"


# ---- client -> server ---------------------------------------------------------------------


class Auth(msgspec.Struct, tag="auth", tag_field="type", forbid_unknown_fields=True):
    key: str


class Generate(msgspec.Struct, tag="generate", tag_field="type", forbid_unknown_fields=True):
    id: RequestId
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: dict[str, Any] = {}  # SamplingParams fields, and `lora` (an adapter's name)
    # The end user (or session) this request is for, as OpenAI's `user`: its private blocks
    # are salted per user, so users of one key share only the key's pinned prefixes.
    user: UserId | None = None
    # with `messages`: OpenAI's tools and tool_choice ("none", "auto", "required" or named)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = False  # true: a forced call may be several calls (else exactly one)


class Abort(msgspec.Struct, tag="abort", tag_field="type", forbid_unknown_fields=True):
    id: RequestId


class KvStateRequest(msgspec.Struct, tag="kv_state", tag_field="type", forbid_unknown_fields=True):
    pass


ClientMessage = Auth | Generate | Abort | KvStateRequest


class _IdProbe(msgspec.Struct):
    """Lenient view of a rejected message, to address the error to its request id if any
    (an over-long id fails this too, so it is never echoed)."""

    id: RequestId | None = None


# ---- server -> client ---------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", tag_field="type"):
    model: str
    block_size: int
    max_prompt_tokens: int | None = None


class Delta(msgspec.Struct, tag="delta", tag_field="type", omit_defaults=True):
    id: str
    index: int
    text: str
    token_ids: list[int]
    # One dict per new token: token id -> logprob (the sampled token plus the top-k).
    logprobs: list[dict[int, float]] | None = None
    # With tools: what the sample's calls gained since the last delta (not in `text`); the
    # parts of one call that arrive together are merged into one entry.
    tool_calls: list[DeltaToolCall] | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


class Done(msgspec.Struct, tag="done", tag_field="type"):
    id: str
    finish_reason: str | None  # of sample 0; `finish_reasons` has one per sample
    usage: Usage
    finish_reasons: list[str | None] = []


class Error(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    id: str | None
    code: str
    message: str
    limit: str | None = None  # with limit_exceeded: which limit (a config or SamplingParams name)
    retry_after: float | None = None  # with overloaded: seconds to wait before trying again


class KvState(msgspec.Struct, tag="kv_state", tag_field="type", omit_defaults=True):
    block_size: int
    num_blocks: int
    # One digit per physical block: 0 free, 1 cached-free, 2 in use, 3 shared, 4 pinned.
    blocks: str
    counts: dict[str, int]
    # When the engine reports owners: the tenant names, and per block an index into them
    # (-1: no owner). The name "*" stands for a block held by several tenants (a shared prefix).
    tenants: list[str] | None = None
    owners: list[int] | None = None


ServerMessage = Ready | Delta | Done | Error | KvState


class TooDeep(ValueError):
    """A message nested deeper than the decoder can follow."""


class Codec:
    """Per-connection encoder/decoder pair (msgspec's are cheap, but reuse avoids rebuilds)."""

    __slots__ = ("_decoder", "_encoder", "_probe")

    def __init__(self) -> None:
        self._decoder = msgspec.json.Decoder(ClientMessage)
        self._probe = msgspec.json.Decoder(_IdProbe)
        self._encoder = msgspec.json.Encoder()

    def decode(self, data: str | bytes) -> ClientMessage:
        """Raises msgspec.DecodeError (bad JSON), msgspec.ValidationError (bad shape) or
        TooDeep (msgspec's RecursionError, raised even inside fields it would skip)."""
        try:
            return self._decoder.decode(data)
        except RecursionError:
            raise TooDeep("JSON nested too deeply") from None

    def probe_id(self, data: str | bytes) -> str | None:
        try:
            return self._probe.decode(data).id
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None

    def encode(self, message: ServerMessage) -> str:
        return self._encoder.encode(message).decode()


KV_STATE_NAMES = ("free", "cached", "used", "shared", "pinned")


def kv_state_message(state: dict[str, Any]) -> KvState:
    """Turns `engine.kv_state()` into the compact wire form (one character per block)."""
    blocks = state["blocks"]
    counts = [0] * len(KV_STATE_NAMES)
    for code in blocks:
        counts[code] += 1
    names, owners = _owners(state.get("tenants"))
    return KvState(
        block_size=int(state["block_size"]),
        num_blocks=int(state["num_blocks"]),
        blocks="".join("01234"[code] for code in blocks),
        counts=dict(zip(KV_STATE_NAMES, counts, strict=True)),
        tenants=names,
        owners=owners,
    )


def _owners(per_block: list[str | None] | None) -> tuple[list[str] | None, list[int] | None]:
    """Per-block tenant names as (distinct names, per block an index or -1): a name is sent
    once, not once per block."""
    if per_block is None:
        return None, None
    names = sorted({name for name in per_block if name is not None})
    index = {name: i for i, name in enumerate(names)}
    return names, [-1 if name is None else index[name] for name in per_block]
