"""What the ingress sends a replica for one request, and what the router reads to place it."""

from __future__ import annotations

from dataclasses import dataclass

from streamengine.sample.sampling_params import SamplingParams
from streamengine.tenancy.pinning import Segments


@dataclass(frozen=True, slots=True)
class ClusterAdapter:
    """A LoRA adapter as the cluster serves it: the folder a replica that lacks it loads it
    from, and the digest of its files (with the name, what its blocks are hashed with)."""

    name: str
    path: str
    digest: str


@dataclass(slots=True)
class ReplicaRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    cache_salt: str | None
    tenant: str | None
    # The salts of the prompt's blocks, computed by the ingress exactly as the engine does
    # (Pins.segments): the router hashes the prompt with them to find where it is cached.
    salt_segments: Segments = ()
    lora: ClusterAdapter | None = None  # the LoRA adapter it runs under (None: the base model)
    # The prompt as text, for routers that match text (Ray's PrefixCacheAffinityRouter reads
    # `.prompt`); empty unless the application routes that way: ours reads the token ids.
    prompt: str = ""
    # The hashes the router looked up, kept so that placing the request (choose_replicas, then
    # on_request_routed, again on a retry) hashes the prompt once.
    block_hashes: list[bytes] | None = None
