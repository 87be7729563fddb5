"""WebSocket protocol of `/v1/stream`: JSON messages as msgspec tagged unions (`"type"` field).

Client -> server: `auth`, `generate`, `abort`, `kv_state`.
Server -> client: `ready`, `delta`, `done`, `error`, `kv_state`.

Sampling parameters travel as a plain object and are converted into the engine's own
`SamplingParams`, so every knob the engine accepts is available here with its own validation.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Error codes sent in `error.code`; the WebSocket stays open after each of these.
BAD_JSON = "bad_json"
BAD_MESSAGE = "bad_message"
BAD_PARAMS = "invalid_params"
DUPLICATE_ID = "duplicate_id"
UNKNOWN_ID = "unknown_id"
MESSAGE_TOO_LARGE = "message_too_large"
PROMPT_TOO_LONG = "prompt_too_long"
TOO_MANY_REQUESTS = "too_many_requests"
ENGINE_ERROR = "engine_error"

# Close codes. 4001 is in the private range (4000-4999) that applications may define.
CLOSE_UNAUTHORIZED = 4001
PROTOCOL_NAME = "streamengine.v1"
BEARER_PROTOCOL_PREFIX = "bearer."


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


# ---- client -> server ---------------------------------------------------------------------


class Auth(msgspec.Struct, tag="auth", tag_field="type", forbid_unknown_fields=True):
    key: str


class Generate(msgspec.Struct, tag="generate", tag_field="type", forbid_unknown_fields=True):
    id: str
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: dict[str, Any] = {}


class Abort(msgspec.Struct, tag="abort", tag_field="type", forbid_unknown_fields=True):
    id: str


class KvStateRequest(msgspec.Struct, tag="kv_state", tag_field="type", forbid_unknown_fields=True):
    pass


ClientMessage = Auth | Generate | Abort | KvStateRequest


class _IdProbe(msgspec.Struct):
    """Lenient view of a rejected message, to address the error to its request id if any."""

    id: str | None = None


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


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


class Done(msgspec.Struct, tag="done", tag_field="type"):
    id: str
    finish_reason: str | None  # of sample 0; `finish_reasons` has one per sample
    usage: Usage
    finish_reasons: list[str | None] = []


class Error(msgspec.Struct, tag="error", tag_field="type"):
    id: str | None
    code: str
    message: str


class KvState(msgspec.Struct, tag="kv_state", tag_field="type"):
    block_size: int
    num_blocks: int
    # One digit per physical block: 0 free, 1 cached-free, 2 in use, 3 shared.
    blocks: str
    counts: dict[str, int]


ServerMessage = Ready | Delta | Done | Error | KvState


class Codec:
    """Per-connection encoder/decoder pair (msgspec's are cheap, but reuse avoids rebuilds)."""

    __slots__ = ("_decoder", "_encoder", "_probe")

    def __init__(self) -> None:
        self._decoder = msgspec.json.Decoder(ClientMessage)
        self._probe = msgspec.json.Decoder(_IdProbe)
        self._encoder = msgspec.json.Encoder()

    def decode(self, data: str | bytes) -> ClientMessage:
        """Raises msgspec.DecodeError (bad JSON) or msgspec.ValidationError (bad shape)."""
        return self._decoder.decode(data)

    def probe_id(self, data: str | bytes) -> str | None:
        try:
            return self._probe.decode(data).id
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def encode(self, message: ServerMessage) -> str:
        return self._encoder.encode(message).decode()


KV_STATE_NAMES = ("free", "cached", "used", "shared")


def kv_state_message(state: dict[str, Any]) -> KvState:
    """Turns `engine.kv_state()` into the compact wire form (one character per block)."""
    blocks = state["blocks"]
    counts = [0, 0, 0, 0]
    for code in blocks:
        counts[code] += 1
    return KvState(
        block_size=int(state["block_size"]),
        num_blocks=int(state["num_blocks"]),
        blocks="".join("0123"[code] for code in blocks),
        counts=dict(zip(KV_STATE_NAMES, counts, strict=True)),
    )
