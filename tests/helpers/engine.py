"""Test helpers that drive engines: run a request (or a batch of them) to its end, and the disaggregated path
(prefill on one engine, its blocks copied, decode on another) as the workers take it."""

from __future__ import annotations

import dataclasses

from engine import EngineCore, RequestOutput, SamplingParams


def run_until_finished(engine: EngineCore, request_id: str) -> RequestOutput:
    """Step ``engine`` until request ``request_id`` finishes; return its last output."""
    while True:
        for out in engine.step().outputs:
            if out.request_id == request_id and out.finished:
                return out


def run_all(engine: EngineCore,
            requests: dict[str, tuple[str | list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """Add every request (id → prompt, params) to ``engine`` and step until all have finished;
    return each one's last output."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while len(done) < len(requests):
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = out
    return done


def prefill_then_decode(prefill: EngineCore, decode: EngineCore, request_id: str, prompt: str | list[int],
                        params: SamplingParams) -> RequestOutput:
    """Run one request disaggregated: ``prefill`` computes the prompt's KV and the first token,
    its blocks are copied byte for byte into blocks ``decode`` reserved, and ``decode`` goes on
    from the first token. Returns ``decode``'s last output."""
    ids = prefill.tokenize(prompt)
    first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=[])
    prefill.add_request(request_id, ids, first, pin_prompt_blocks=True)
    first_out = run_until_finished(prefill, request_id)
    src = first_out.pinned_block_ids
    assert len(src) == -(-len(ids) // prefill.config.block_size)
    dst, cached = decode.reserve_blocks(ids)
    decode.kv_cache.tensor[dst[cached:]] = prefill.kv_cache.tensor[src[cached:]]
    assert prefill.release(request_id)
    first_tokens = [c.token_ids[0] for c in first_out.outputs]
    out = decode.add_prefilled_request(request_id, ids, first_tokens, params, dst)
    return out if out.finished else run_until_finished(decode, request_id)
