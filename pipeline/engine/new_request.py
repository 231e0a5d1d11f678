"""Engine stage: a client's EngineRequest made into the engine's Requests (one per completion).

Owns / State: nothing; pure construction and the checks only the engine can make. A request
of ``n > 1`` completions (parallel sampling) becomes n child Requests under the client's id,
each with its own params (``child_params``); the scheduler queues the first and holds its
siblings until the prompt's KV is cached, so they take it from the prefix cache.
"""
from __future__ import annotations

from collections.abc import Collection

import msgspec

from pipeline.engine.kv_connector.base import KVConnector, check_kv_transfer
from pipeline.engine.request import Request
from pipeline.messages import EngineRequest, bytes_to_ids
from pipeline.messages.engine_outputs import child_id
from pipeline.sampling_params import SamplingParams


def child_params(sp: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index``'s own params: one sample, its own seed (seed + index, as vLLM),
    and only the first child computes the prompt's logprobs."""
    return msgspec.structs.replace(
        sp, n=1, seed=None if sp.seed is None else (sp.seed + index) % 2**63,
        prompt_logprobs=sp.prompt_logprobs if index == 0 else None)


def make_requests(er: EngineRequest, taken: Collection[str], block_size: int, num_blocks: int,
                  connector: KVConnector | None, pooling: str = "last") -> list[Request]:
    """The children of ``er`` (one when n == 1), not registered anywhere yet. ValueError if
    an id is ``taken``, if the connector refuses it, or if it could never fit in the whole
    KV cache (``num_blocks``), which only the engine knows. ``pooling``: how the worker pools
    an embedding request (``er.embed``: one prefill, no sampling, no disaggregation)."""
    sp = er.sampling_params
    n = sp.n
    if er.embed and (n != 1 or er.kv_transfer is not None):
        raise ValueError("an embedding request has n=1 and no kv_transfer")
    ids = [child_id(er.req_id, k, n) for k in range(n)]
    req_ids = {er.req_id, *ids}
    for rid in req_ids:
        if rid in taken:
            raise ValueError(f"request id {rid!r} is already in the engine")
    prompt = bytes_to_ids(er.prompt_token_ids).tolist()
    max_tokens = 1 if er.embed else sp.max_tokens
    if connector is not None:
        connector.check_request(er, req_ids, len(prompt))
        max_tokens = connector.tokens_to_fit(er, len(prompt))
    elif er.kv_transfer is not None:
        check_kv_transfer(er, "mixed", block_size, len(prompt))
    # The last sampled token's KV is never computed, hence total - 1.
    need = -(-(len(prompt) + max_tokens - 1) // block_size)
    if need > num_blocks:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs "
                         f"{need} KV blocks of {block_size} tokens, more than the whole "
                         f"KV cache (num_blocks={num_blocks})")
    eos = frozenset(er.eos_token_ids)
    params_bytes = len(msgspec.msgpack.encode(sp)) + len(er.grammar or b"")
    return [Request(rid, prompt, child_params(sp, k) if n > 1 else sp, er.arrival_time,
                    eos, er.priority, er.cache_salt, out_id=er.req_id, index=k,
                    params_bytes=params_bytes, grammar=er.grammar, embed=er.embed,
                    pool_mean=er.embed and pooling == "mean")
            for k, rid in enumerate(ids)]
