"""What one app's routes share: the engine, limits, security policy, metrics, live sessions."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from jinja2 import TemplateError

from streamengine.engine.intake import encode_prompt
from streamengine.errors import PromptTooLong
from streamengine.server.fair_pool import FairPool
from streamengine.server.metrics import ServerMetrics
from streamengine.server.security import ANONYMOUS, HostPolicy, KeyRing, OriginPolicy, Tenant
from streamengine.structured.tool_prompt import (
    needs_tools_template,
    render_messages,
    template_messages,
    template_renders_tools,
)

if TYPE_CHECKING:  # the engine loads torch and the model code: the server's modules do not need it
    from streamengine.engine.client import EngineClient
    from streamengine.server.config import ServerConfig

INLINE_TOKENIZE_CHARS = 8192
"""Longer prompts are tokenized in a worker thread rather than on the event loop."""
TOKENIZER_THREADS = 1
"""Prompts are tokenized by one thread, the tokenizer never by two of ours at once; clients
take turns in its queue (FairPool), so one client's huge prompts cannot hold up another's."""
CLIENT: ContextVar[str] = ContextVar("streamengine_client", default="")
"""Who the request being handled comes from (`client_key`): whose turn its jobs wait for in
queues shared by every client. Set by the auth middleware and by each WebSocket request task."""


def client_key(tenant: Tenant, remote: str | None) -> str:
    """A client for fair turns: its tenant, or its peer address on a server without keys
    (where everyone is the same anonymous tenant)."""
    return f"address {remote}" if tenant is ANONYMOUS else f"tenant {tenant.name}"


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token stands for: the longest entry of the vocabulary.
    A byte-level BPE entry has one character per byte (at least as many as the text it decodes
    to); a SentencePiece entry one per character (byte fallbacks, like <0x0A>, more)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


class Socket(Protocol):
    """What the server's state and its drain use of an open WebSocket (websocket.Connection,
    which imports this module: typed by what it offers, the two modules import one way)."""

    live: Mapping[str, object]  # its requests in flight, by id

    async def close(self, code: int, reason: str, *, request_error: tuple[str, str] | None = None) -> None: ...


# Arguments of transformers' apply_chat_template that are not template variables: a client's
# chat_template_kwargs may not set them (they would change what the call returns, or replace
# what the server renders).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class BadTemplateOptions(ValueError):
    """Chat template options that contradict each other; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a conversation is rendered (vLLM's chat request fields): a generation prompt after
    it, or its last message left open for the model to continue, and variables for the
    template (`chat_template_kwargs`, `documents`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    documents: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise BadTemplateOptions("continue_final_message needs add_generation_prompt false: the model "
                                     "continues the last message instead of starting a new one",
                                     "continue_final_message")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & self.template_kwargs.keys())
        if reserved:
            raise BadTemplateOptions(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                     "chat_template_kwargs")

    def call_kwargs(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments; only what differs from its defaults beyond
        add_generation_prompt, so stand-in tokenizers with fewer arguments keep working."""
        kwargs: dict[str, Any] = {**self.template_kwargs, "add_generation_prompt": self.add_generation_prompt}
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return kwargs


DEFAULT_CHAT_TEMPLATE = ChatTemplateOptions()


@dataclass(slots=True, eq=False)
class ServerState:
    """The server's live state: its engine, its options (`config`) and what it built from them
    once (the model name answered, the key ring, the origin and host policies, the metrics),
    the sockets and requests in flight, and its tokenizer threads."""

    engine: EngineClient  # AsyncEngine, ClusterEngine, or a test's stand-in
    config: ServerConfig
    model_name: str  # config.model_name, or the engine's
    keys: KeyRing
    origins: OriginPolicy
    metrics: ServerMetrics
    hosts: HostPolicy = field(default_factory=HostPolicy)
    created: int = field(default_factory=lambda: int(time.time()))
    connections: set[Socket] = field(default_factory=set)  # every open WebSocket
    unauthenticated: set[Socket] = field(default_factory=set)  # those still to authenticate
    # Engine request ids of HTTP requests in flight, each with a check that its client has left:
    # aborted on shutdown so handlers end fast, and when their client leaves (watch_http_clients).
    http_requests: dict[str, Callable[[], bool]] = field(default_factory=dict)
    shutting_down: bool = False  # True from the start of a drain: no new requests are admitted
    # OpenAI POSTs being handled (tokenizing, generating or writing): a drain waits for these.
    http_in_flight: int = 0
    _tokenizer_pool: FairPool | None = None
    _token_chars: int = 0  # longest_token_chars of the engine's tokenizer, once known
    _context_tokens: int | None = None  # the engine's max_model_len, once known
    _id_objects: tuple[int, ...] = ()  # one int object per token id (see _shared_ids)

    async def tokenize_async(self, prompt: str | list[int], *, chat: bool = False,
                             check_limit: bool = True) -> list[int]:
        """`tokenize`, off the event loop for long prompts so other streams keep flowing, in
        the turn of the request's client (CLIENT); a prompt too long in characters to fit is
        refused first, without tokenizing (`check_chars`)."""
        if isinstance(prompt, str):
            self.check_chars(prompt, check_limit=check_limit)
        if not isinstance(prompt, str) or len(prompt) <= INLINE_TOKENIZE_CHARS:
            return self.tokenize(prompt, chat=chat, check_limit=check_limit)
        if self._tokenizer_pool is None:
            self._tokenizer_pool = FairPool(TOKENIZER_THREADS, "streamengine-tokenize")
        job = functools.partial(self.tokenize, prompt, chat=chat, check_limit=check_limit)
        return await self._tokenizer_pool.run(CLIENT.get(), job)

    def check_chars(self, prompt: str, *, check_limit: bool = True) -> None:
        """PromptTooLong for a prompt of more characters than the most tokens it may have
        (the context, or `max_prompt_tokens` when `check_limit`) could spell at the longest
        token's length: it cannot fit, so it is not worth tokenizing (megabytes take seconds)."""
        if self._context_tokens is None:
            self._context_tokens = int(self.engine.stats().get("max_model_len") or 0)
        limits = [(self._context_tokens, "the model's context of {} tokens")]
        if check_limit and self.config.max_prompt_tokens is not None:
            limits.append((self.config.max_prompt_tokens, "this server's limit of {} tokens (--max-prompt-tokens)"))
        tokens, limit = min(((n, what) for n, what in limits if n), default=(0, ""))
        if not tokens or len(prompt) <= tokens:  # one character per token at least: fits
            return
        if not self._token_chars:
            self._token_chars = longest_token_chars(self.engine.tokenizer)
        if len(prompt) > tokens * self._token_chars:
            raise PromptTooLong(
                f"prompt has {len(prompt)} characters, more than {limit.format(tokens)} can hold at "
                f"{self._token_chars} characters per token (the longest token of this tokenizer): "
                "refused without tokenizing")

    def lora_adapters(self) -> dict[str, str]:
        """The engine's loaded LoRA adapters, name -> folder ({} for an engine without them)."""
        listing = getattr(self.engine, "lora_adapters", None)  # a test's stand-in may lack it
        return {adapter["name"]: adapter["path"] for adapter in listing()} if listing is not None else {}

    def lora_param(self, name: object) -> str | None:
        """A request's `lora` parameter (WebSocket params.lora): a loaded adapter's name, or None
        (the tenant's adapter or the base model); ValueError naming what is wrong."""
        if name is None:
            return None
        if not isinstance(name, str) or not name:
            raise ValueError(f"params.lora must be a LoRA adapter's name (a non-empty string), got {name!r}")
        loaded = self.lora_adapters()
        if name not in loaded:
            raise ValueError(f"params.lora: no LoRA adapter named {name!r} is loaded (loaded: {sorted(loaded)})")
        return name

    def close(self) -> None:
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.close()
            self._tokenizer_pool = None

    def tokenize(self, prompt: str | list[int], *, chat: bool = False, check_limit: bool = True) -> list[int]:
        """The prompt's token ids (intake.encode_prompt, the engine's own rule), checked against
        the server limit (unless `check_limit` is false: `check_length` then, on the ids the
        request keeps).

        The server tokenizes once and hands the ids to the engine, so the limit is enforced
        before any work is queued and the prompt is not tokenized twice. `chat`: the prompt
        was rendered by the chat template (`chat_prompt`), which writes the special tokens
        itself (the BOS among them), so the tokenizer must add none: a tokenizer that adds
        a BOS (Llama's, Mistral's, Gemma's) would start the prompt with two.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self._shared_ids(encode_prompt(self.engine.tokenizer, prompt, chat=chat))
        else:
            ids = list(prompt)
        if check_limit:
            self.check_length(ids)
        return ids

    def _shared_ids(self, ids: list[int]) -> list[int]:
        """`ids` made of one shared int object per token id. The tokenizer returns a new int
        object (28 bytes) for every id above 256, so a queued prompt held 28 bytes per token
        beyond its lists' 8 per reference; shared, a long prompt waiting in the queue takes
        about half the memory. Ids come from the tokenizer, so all are below len(tokenizer)."""
        if not self._id_objects:
            self._id_objects = tuple(range(len(self.engine.tokenizer)))
        objects = self._id_objects
        return [objects[i] for i in ids]

    def check_length(self, ids: list[int]) -> None:
        """PromptTooLong past the server's `max_prompt_tokens`."""
        if self.config.max_prompt_tokens is not None and len(ids) > self.config.max_prompt_tokens:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens, more than this server's limit of "
                f"{self.config.max_prompt_tokens} (--max-prompt-tokens)"
            )

    def chat_prompt(self, messages: Sequence[dict[str, Any]], functions: list[dict[str, Any]] | None = None,
                    options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE) -> str:
        """The prompt of chat `messages` (OpenAI's shapes, content as text), with `functions`
        (the tools' function definitions) when the request offers tools (see tool_prompt.py),
        rendered as `options` say."""
        if not messages:
            raise ValueError("messages must not be empty")
        messages = list(messages)
        template = getattr(self.engine.tokenizer, "chat_template", None)
        if template_renders_tools(template) and needs_tools_template(messages, functions):
            return self._template_with_tools(messages, functions, options)
        rendered = render_messages(messages, functions)
        try:
            if options == DEFAULT_CHAT_TEMPLATE:
                return self.engine.apply_chat_template(rendered)
            return self.engine.tokenizer.apply_chat_template(rendered, tokenize=False, **options.call_kwargs())
        except TemplateError as exc:  # the template refusing the conversation (see below)
            raise _template_refused(exc) from None

    def _template_with_tools(self, messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None,
                             options: ChatTemplateOptions) -> str:
        tools = [{"type": "function", "function": f} for f in functions] if functions else None
        try:
            return self.engine.tokenizer.apply_chat_template(
                template_messages(messages), tools=tools, tokenize=False, **options.call_kwargs())
        except Exception as exc:  # noqa: BLE001 - a template's own error (jinja raises its own types)
            raise _template_refused(exc) from None


def _template_refused(exc: Exception) -> ValueError:
    """The client's error for a conversation the chat template will not render. Templates
    raise jinja's own exceptions, not ValueError (Llama 2's, Mistral's and Gemma's call
    `raise_exception` when roles do not alternate): as they were, they reached clients as a
    500 / `engine_error`, a server bug, for what is a bad request."""
    return ValueError(f"the chat template cannot render these messages: {exc}")


STATE_KEY = web.AppKey("streamengine_state", ServerState)
# RequestKey arrived in aiohttp 3.12; older versions take a plain string key.
TENANT_KEY: Any = (
    web.RequestKey("streamengine_tenant", Tenant) if hasattr(web, "RequestKey") else "streamengine_tenant"
)


def get_state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
