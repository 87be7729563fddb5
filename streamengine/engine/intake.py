"""Checks a new request against the engine's model and limits before it is queued.

Every check raises ValueError (or its subclass LimitExceededError for a configured limit)
naming what is wrong, so a bad request is refused whole and nothing is allocated for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamengine.errors import LimitExceededError
from streamengine.sample.sampling_params import SamplingParams


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """A text prompt's token ids: the one rule of the engine, the server and the Ray ingress.

    `chat`: the text was rendered by the chat template, which writes the special tokens itself,
    so the tokenizer adds none. Otherwise the tokenizer adds its own (its BOS), except a second
    BOS: a text that starts with the BOS already (a template rendered by the caller, as
    `generate(engine.apply_chat_template(...))` does) would get two from a BOS-adding
    tokenizer (Llama's, Mistral's, Gemma's), a start the model never saw in training."""
    if chat:
        return tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[:2] == [bos, bos] and text.startswith(tokenizer.bos_token):
        return ids[1:]
    return ids


@dataclass(frozen=True, slots=True)
class Intake:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_tokens_cap: int | None
    pool_tokens: str  # how the KV pool limits the context, for messages ("N blocks x 16")

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = encode_prompt(self.tokenizer, prompt)
            if not ids:  # a tokenizer without BOS may drop every character: nothing to compute
                raise ValueError("prompt tokenizes to no tokens")
            # A tokenizer may know more ids than the model has embeddings (added tokens): such an
            # id would fail the whole forward pass, and every request batched with it.
            if max(ids) >= self.vocab_size:
                raise ValueError(
                    f"the prompt tokenizes to id {max(ids)}, out of range of the model's "
                    f"vocabulary [0, {self.vocab_size})"
                )
            return ids
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is out of range [0, {self.vocab_size})")
        return list(prompt)

    def check_length(self, prompt_len: int, params: SamplingParams) -> None:
        room = self.max_model_len - prompt_len
        wanted = params.max_tokens if params.max_tokens is not None else 1
        if wanted > room:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({wanted}) exceeds the maximum "
                f"context length of {self.max_model_len} tokens (model context and KV pool of "
                f"{self.pool_tokens})"
            )

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The request's stop token ids as a set (a set, not a list scan: a long list must not
        stall the event loop), each checked against this model's vocabulary."""
        stop_ids = frozenset(params.stop_token_ids)
        if stop_ids and max(stop_ids) >= self.vocab_size:
            raise ValueError(
                f"stop_token_ids must be < the model's vocabulary size ({self.vocab_size}), "
                f"got {max(stop_ids)}"
            )
        return stop_ids

    def check_logit_bias(self, params: SamplingParams) -> None:
        """Each biased token id is in this model's vocabulary."""
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(
                f"logit_bias token ids must be < the model's vocabulary size ({self.vocab_size}), "
                f"got {max(params.logit_bias)}"
            )

    def max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's output limit: its own max_tokens (refused above the engine's cap), or
        for max_tokens=None the cap or the room left in the context, whichever is smaller."""
        cap = self.max_tokens_cap
        if params.max_tokens is None:
            room = self.max_model_len - prompt_len
            return room if cap is None else min(cap, room)
        if cap is not None and params.max_tokens > cap:
            raise LimitExceededError(
                "max_tokens_cap",
                f"max_tokens ({params.max_tokens}) exceeds this engine's limit of {cap} output "
                f"tokens per request (EngineConfig.max_tokens_cap)",
            )
        return params.max_tokens
