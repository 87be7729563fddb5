"""vLLM's run-time LoRA routes: `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`) and
`POST /v1/unload_lora_adapter` (`lora_name`). Admin keys only (middlewares.py): an adapter
changes what every tenant may be served, and its path is a folder on the server's machine.

Success is a 200 with a one-line text, as vLLM answers. A missing or mistyped field is a 400
naming it; an adapter the engine will not load is a 400 with the engine's reason (LoRAError);
unloading a name no adapter has is a 404. Unloading refuses new requests for the adapter at
once and answers when the requests running on it have ended.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from streamengine.server.openai.endpoints import decode_body
from streamengine.server.openai.errors import OpenAIError
from streamengine.server.state import ServerState, get_state


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str | None = None


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = get_state(request)
    body = decode_body(await request.read(), LoadLoRAAdapterRequest)
    name = _required(body.lora_name, "lora_name")
    path = _required(body.lora_path, "lora_path")
    if name == state.model_name:
        raise OpenAIError(400, f"lora_name `{name}` is the base model's id: an adapter needs a name of its own",
                          param="lora_name")
    try:
        await state.engine.add_lora(name, path)
    except ValueError as exc:  # LoRAError: what is wrong with the folder, or the name taken
        taken = name in state.lora_adapters()
        raise OpenAIError(400, str(exc), param="lora_name" if taken else "lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = get_state(request)
    name = _required(decode_body(await request.read(), UnloadLoRAAdapterRequest).lora_name, "lora_name")
    if name not in state.lora_adapters():
        raise _not_loaded(state, name)
    try:
        await state.engine.remove_lora(name)
    except ValueError as exc:  # gone meanwhile (another unload), or an engine that cannot unload
        if name not in state.lora_adapters():
            raise _not_loaded(state, name) from None
        raise OpenAIError(400, str(exc), param="lora_name") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _required(value: str | None, field: str) -> str:
    if not value:
        raise OpenAIError(400, f"{field} is required: a non-empty string", param=field)
    return value


def _not_loaded(state: ServerState, name: str) -> OpenAIError:
    loaded = ", ".join(f"`{n}`" for n in sorted(state.lora_adapters())) or "none"
    return OpenAIError(404, f"no LoRA adapter named `{name}` is loaded (loaded: {loaded})", param="lora_name",
                       code="model_not_found")
