"""KV fault injection for the end-to-end integrity tests (``tests/e2e/test_kv_integrity.py``),
never part of a deployment: Python imports ``sitecustomize`` at start-up from the first folder
of ``PYTHONPATH`` that has one, and a test puts this folder there for one worker process only.

At each transfer the worker reads the fault to inject from the file named by ``KV_FAULT_FILE``
(missing or empty: none), so one cluster meets every fault in turn. Faults sit at the
transport boundary, between the bytes a sender digested and where the receiver verifies them:

- on a decode worker, where blocks land (``KVPool.scatter`` for gRPC, ``NixlAgent.read``):
  ``flip`` (one bit of the first block), ``truncate`` (the second half of the first block's
  bytes never written: zeros), ``wrong_slot`` (the first block's bytes taken from another slot);
- on a prefill worker, what it sends: ``random`` (its blocks overwritten with random bytes
  before it digests them, a worker returning garbage, and given back their own bytes when the
  stream ends; the test's prompt fits one prefill chunk, so the prefill has read them already),
  ``layout`` (its blocks announced in another
  dtype: a peer of another KV layout).
"""

from __future__ import annotations

import os
from pathlib import Path


def fault() -> str:
    """The fault the test asks for now (``""``: none)."""
    path = os.environ.get("KV_FAULT_FILE", "")
    try:
        return Path(path).read_text().strip() if path else ""
    except FileNotFoundError:
        return ""


def _spoil_landed(pool, block_ids) -> None:
    """Apply a landing fault to rank 0's part of ``block_ids[0]``."""
    import torch

    kind = fault()
    raw = pool.ranks[0].tensor[block_ids[0]].view(-1).view(torch.uint8)
    if kind == "flip":
        raw[raw.numel() // 3] ^= 0x04
    elif kind == "truncate":  # (zeros: a slot's stale bytes may be this very KV, from an earlier try)
        raw[raw.numel() // 2:] = 0
    elif kind == "wrong_slot":  # the nearest slot holding other bytes (a stale slot may hold this very KV)
        for step in range(1, pool.num_blocks):
            other = pool.ranks[0].tensor[(block_ids[0] + step) % pool.num_blocks].view(-1).view(torch.uint8)
            if not torch.equal(other, raw):
                raw.copy_(other)
                break


def _other_dtype(dtype):
    """A KV dtype other than ``dtype``."""
    import torch

    return torch.float32 if dtype == torch.float16 else torch.float16


def _install() -> None:
    import torch

    from kvtransfer import client, nixl, pool, wire

    scatter = pool.KVPool.scatter

    def faulty_scatter(self, block_ids, blocks):
        scatter(self, block_ids, blocks)
        _spoil_landed(self, block_ids)

    read = nixl.NixlAgent.read

    async def faulty_read(self, peer, src_blocks, dst_blocks):
        await read(self, peer, src_blocks, dst_blocks)
        _spoil_landed(self.pool, dst_blocks)

    send = client.KVTransferStream.send

    async def faulty_send(self, kv_pool, first_index, block_ids):
        kind = fault()
        if kind == "random":  # the blocks' own bytes come back when the stream ends (see faulty_exit)
            self.spoiled = getattr(self, "spoiled", [])
            for part in kv_pool.ranks:
                for block in block_ids:
                    raw = part.tensor[block].view(-1).view(torch.uint8)
                    self.spoiled.append((raw, raw.clone()))
                    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=raw.device))
        if kind == "layout" and self.nixl is None:
            encode = client.encode_chunk
            client.encode_chunk = lambda blocks, **kwargs: encode(blocks.to(_other_dtype(blocks.dtype)), **kwargs)
            try:
                return await send(self, kv_pool, first_index, block_ids)
            finally:
                client.encode_chunk = encode
        return await send(self, kv_pool, first_index, block_ids)

    write = client.KVTransferStream._write

    async def faulty_write(self, chunk):
        if fault() == "layout" and chunk.HasField("nixl_source"):
            chunk.layout.dtype = str(_other_dtype(wire.KV_DTYPES[chunk.layout.dtype])).removeprefix("torch.")
        await write(self, chunk)

    exit_stream = client.KVTransferStream.__aexit__

    async def faulty_exit(self, *exc):
        await exit_stream(self, *exc)
        for raw, original in getattr(self, "spoiled", []):  # (the worker's cache stays its own)
            raw.copy_(original)

    pool.KVPool.scatter = faulty_scatter
    client.KVTransferStream.__aexit__ = faulty_exit
    nixl.NixlAgent.read = faulty_read
    client.KVTransferStream.send = faulty_send
    client.KVTransferStream._write = faulty_write


if os.environ.get("KV_FAULT_FILE"):
    _install()
