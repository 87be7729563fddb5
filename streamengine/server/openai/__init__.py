"""OpenAI-compatible HTTP: `/v1/models` (and `/v1/models/{id}`), `/v1/completions`,
`/v1/chat/completions`, and vLLM's `/tokenize`, `/detokenize`, `/version` and LoRA routes
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

A request's `model` is the base model's id or a loaded LoRA adapter's name, which runs the
request under that adapter and is echoed in the response's `model`; /v1/models lists both.

Request bodies are decoded with msgspec into the fields each endpoint implements (OpenAI's and
vLLM's); any other field OpenAI or vLLM defines is refused by name (fields.py), and only fields
neither defines pass unread. They are mapped onto the engine's SamplingParams (a list of
completion prompts onto one engine request each, batch.py), and streamed as server-sent
events ending with `data: [DONE]` when `stream` is true. Streaming responses start once the first output exists,
so a request the engine refuses still gets a plain status: 400 for bad params, a context too
long or an engine limit (`param` names the limit, code `limit_exceeded`), 429 with Retry-After
when the engine's queue is full, 500 with the engine's message when it fails the request, 504
past the server's request timeout. After the first chunk, a failure is reported in-band (an
`{"error": ...}` event, then `data: [DONE]`). A client that goes away has its request
aborted within a fraction of a second, also while it still waits for its first output. Past a tenant's `tokens_per_minute` the answer is 429
with Retry-After, code `rate_limit_exceeded` and `param` "tokens_per_minute".

`user` is honoured: it salts the request's private prefix-cache blocks per user (hashed with a
secret of the key's tenant). Users of one key (one bot) still share its pinned system prompt,
but no user's messages are a cache hit for another, so `usage.prompt_tokens_details.
cached_tokens` cannot reveal what someone else asked. Requests without `user` share blocks
across the whole key, as before.

`response_format` (json_object, json_schema) and the `structured` extension constrain the
output (400 `invalid_grammar` for a spec that does not compile); `tools` / `tool_choice` are
planned in server/tools.py, rendered by tool_prompt.py and read back by tool_calls.py into
`message.tool_calls` / `delta.tool_calls` with finish_reason "tool_calls".

schemas.py holds the bodies, fields.py the table of every field, endpoints.py what differs
between the two endpoints (one object each), prompts.py the prompts' forms, truncation and echo,
guided.py vLLM's structured-output spellings, format.py builds response bodies from stream
updates, batch.py runs a request's engine streams side by side, routes.py the handlers,
tokenize.py the tokenizer routes, lora.py the LoRA routes.
"""

from streamengine.server.openai.errors import OpenAIError, error_response, http_exception_response
from streamengine.server.openai.routes import add_routes
from streamengine.server.openai.schemas import ChatCompletionRequest, CompletionRequest

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "OpenAIError",
    "add_routes",
    "error_response",
    "http_exception_response",
]
