"""A step's input tensors, built on the host into persistent buffers and copied to the device at once.

The buffers are views of one host allocation (pinned when the device is CUDA, so the copy is an
asynchronous DMA) and one device allocation, made once and reused every step: no per-step
allocation, fixed device addresses (what a CUDA graph replays from), and a block-table width
fixed at ``cdiv(max_model_len, block_size)`` so that the kernels' stride arguments never change.
Only entries a kernel reads are written: a block-table row past its sequence's blocks keeps
stale (valid) block ids that no kernel reads, and a row whose table did not change since the
last step is not written again.

The block tables come last, so a step's inputs are one prefix of the allocation and go to the
device in one copy: every copy is a call that gives up the GIL and has to win it back, and on a
decode worker (two H200s, Llama-3-8B shape) one copy per input took 0.25 ms of each step's launch
and 1.2 ms in the step a request joined in, while the event loop was busy with that request. The
prefix carries every token input at its full size (five int64 arrays of ``max_num_tokens``, two
of ``max_num_seqs``): at most a few hundred KB, microseconds of DMA.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.runner.attention import AttentionMetadata
from engine.core.block_pool import cdiv
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence


@dataclass
class StepInputs:
    """Everything the forward and the sampler read for one step, on the device.

    Attributes:
        input_ids, positions: ``[num_tokens]`` int64 (padding tokens included).
        metadata: the step's attention metadata.
        sampled: the sequences that sample a token, in batch order (fork children right after
            their parent, sampling from its row; a verify row's sequence once per token it
            samples, speculative decoding).
        logits_indices: ``[len(sampled)]`` int64 token row each sampled token is sampled after
            (a row's last token; each of a verify row's tokens).
        sample_positions: ``[len(sampled)]`` int64 position of the token each one samples.
        num_kv_slots_used, num_kv_slots_allocated: tokens in the scheduled sequences' KV after the
            step, and the slots of their blocks (block_size per block): the reservation waste.
        in_flight: ``(token rows, sampled rows)``, ``[k]`` int64 each: decode rows whose input
            token the step launched before this one sampled, and its row among that step's
            sampled tokens, read on the device (``None``: every input is on the host).
        prompt_chunks: the token rows ``(start, end)`` of each prefill chunk (not a decode's or a
            verification's), in row order; what
            :func:`engine.layers.quantized.prompt_chunks` is given (empty on the other ranks of
            a tensor-parallel engine, which run no quantized layers).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sampled: list[Sequence]
    logits_indices: torch.Tensor
    sample_positions: torch.Tensor
    num_kv_slots_used: int
    num_kv_slots_allocated: int
    in_flight: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt_chunks: tuple[tuple[int, int], ...] = ()


@dataclass
class _StepShape:
    """The sizes and bounds of a prepared step (what :meth:`InputBuffers.pack` sends first)."""

    num_tokens: int  # padding included
    num_rows: int  # sequences, padding rows included
    num_sampled: int
    num_decodes: int  # leading single-token rows, padding rows included
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int
    num_in_flight: int  # decode inputs read from the last step's sampled tokens


# Byte alignment of each input in the allocations (that of a CUDA allocation).
_ALIGN = 256


@dataclass
class Buffer:
    """One input: a NumPy view (``host``) of the host allocation (pinned on CUDA) and the device
    tensor it is copied to (the same memory on the CPU); both are views of their side's one
    allocation."""

    host: np.ndarray
    device: torch.Tensor


class InputBuffers:
    """Host staging arrays and device tensors of up to ``max_num_tokens`` tokens in
    ``max_num_seqs`` sequences.

    Args:
        max_num_tokens: tokens per step at most (padding included).
        max_num_seqs: sequences (rows) per step at most; :meth:`prepare` grows the buffers past
            it when a step has more (e.g. fork children); buffers a CUDA graph captured must
            never grow, so their owner sizes them for its largest batch.
        max_blocks_per_seq: the block table's width.
        block_size: tokens per block.
        device: where the model runs; on the CPU the host arrays are the device tensors.
        fixed_kv_splits: the decode kernel's split count in every step's metadata (a
            batch-invariant engine's one count); ``None``: the kernel's choice per step.
    """

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, fixed_kv_splits: int | None = None) -> None:
        self.fixed_kv_splits = fixed_kv_splits
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self._uploaded: torch.cuda.Event | None = None
        self._allocate(max_num_tokens, max_num_seqs)

    def _allocate(self, max_num_tokens: int, max_num_seqs: int) -> None:
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        t, s = max_num_tokens, max_num_seqs
        # Block tables last: a step's copy is the prefix that ends with its last row.
        specs = [((t,), torch.int64)] * 5 + [((s,), torch.int64)] * 2 + [
            ((s,), torch.int32), ((s + 1,), torch.int32), ((s, self.max_blocks_per_seq), torch.int32)]
        sizes = [cdiv(math.prod(shape) * dtype.itemsize, _ALIGN) * _ALIGN for shape, dtype in specs]
        self._staging = torch.zeros(sum(sizes), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._device = (self._staging if self.device.type == "cpu"
                        else torch.zeros(sum(sizes), dtype=torch.uint8, device=self.device))
        buffers = []
        offset = 0
        for (shape, dtype), size in zip(specs, sizes):
            nbytes = math.prod(shape) * dtype.itemsize
            staging = self._staging[offset:offset + nbytes].view(dtype).view(shape)
            device = self._device[offset:offset + nbytes].view(dtype).view(shape)
            buffers.append(Buffer(staging.numpy(), device))
            offset += size
        self._tables_offset = offset - sizes[-1]
        (self.input_ids, self.positions, self.slot_mapping, self.logits_indices, self.sample_positions,
         self.in_flight_rows, self.in_flight_sampled, self.seq_lens, self.query_start_loc, self.block_tables) = buffers
        # What each block-table row of the host array holds: ``(table, length)`` of the sequence
        # table written there. A table is replaced whenever an entry changes and otherwise only
        # grows (``KVCacheManager``), so a row whose sequence's table is the same list (most
        # decode rows) gets only its new blocks written: O(1) a row, not O(its blocks).
        self._rows: list[tuple[list[int], int] | None] = [None] * max_num_seqs

    def prepare(self, step: SchedulerOutput, pad_to: int | None = None,
                max_decode_seq_len: int | None = None) -> StepInputs:
        """Fill the buffers for ``step`` and copy them to the device.

        Args:
            step: the scheduled batch, decodes first. A step of decodes and verifications
                (:attr:`SchedulerOutput.verifies_as_decodes`) is laid out as decode rows only,
                ``1 + k`` adjacent rows for a verification of ``k`` drafts, row ``j`` at position
                ``start + j`` with its context through it: the step's KV is written before any
                attention reads it, so each row sees the drafts before its own.
            pad_to: for a decode-only step replayed from a CUDA graph, the graph's batch size:
                rows past the step's get one padding token each with slot -1 (nothing is
                written to the KV cache) and sequence length 0 (attention returns 0 for them).
            max_decode_seq_len: the bound the decode kernel sizes its grid with (a CUDA graph's
                fixed bound); default: the step's longest decode context.

        Returns:
            The step's device inputs (tensors are views of the buffers, valid until the next
            call).

        Raises:
            ValueError: ``pad_to`` for a step with prefill chunks.
        """
        bs = self.block_size
        sched = step.scheduled
        nd = step.num_decodes
        as_decodes = step.verifies_as_decodes
        if pad_to is not None and nd != len(sched) and not as_decodes:
            raise ValueError(f"pad_to is for decode-only steps; this one has {len(sched) - nd} prefill chunks")
        row_seqs: list[Sequence] = []  # a verification run as decodes: one row per token
        sampled: list[Sequence] = []
        sample_rows: list[int] = []
        sample_back: list[int] = []  # tokens between a sampled token's input and its row's last
        new_tokens, start_list = [], []
        drafts: dict[int, int] | None = {} if as_decodes else None  # row -> its input draft token
        for s in sched:
            row = len(row_seqs)
            if as_decodes and s.spec_token_ids:
                count = 1 + len(s.spec_token_ids)
                row_seqs += [s.seq] * count
                new_tokens += [1] * count
                start_list += range(s.start, s.start + count)
                sampled += [s.seq] * count
                sample_rows += range(row, row + count)
                sample_back += [0] * count
                drafts.update(zip(range(row + 1, row + count), s.spec_token_ids))
                continue
            row_seqs.append(s.seq)
            new_tokens.append(s.num_new_tokens)
            start_list.append(s.start)
            if s.samples:
                count = s.num_sampled  # a verification samples after each of its tokens
                sampled += [s.seq] * count
                sample_rows += [row] * count
                sample_back.extend(range(count - 1, -1, -1))
                for child in s.forks:
                    sampled.append(child)
                    sample_rows.append(row)
                    sample_back.append(0)
        num_seqs = len(row_seqs)
        if as_decodes:
            nd = num_seqs
        num_rows = pad_to or num_seqs
        num_sampled = len(sampled)
        num_tokens = step.num_tokens + num_rows - num_seqs
        if num_rows > self.max_num_seqs or max(num_tokens, num_sampled) > self.max_num_tokens:
            self._allocate(max(self.max_num_tokens, num_tokens, num_sampled), max(self.max_num_seqs, num_rows))
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's copies have left the host arrays

        query_lens = np.array(new_tokens, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        seq_lens = self.seq_lens.host[:num_rows]
        seq_lens[:num_seqs] = starts + query_lens
        seq_lens[num_seqs:] = 0
        qsl = self.query_start_loc.host[:num_rows + 1]
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1:num_seqs + 1])
        num_real_tokens = int(qsl[num_seqs])
        qsl[num_seqs + 1:] = num_real_tokens + np.arange(1, num_rows - num_seqs + 1)

        input_ids = self.input_ids.host[:num_tokens]
        block_tables = self.block_tables.host
        decode_ids, in_flight_rows, in_flight_sampled = [], [], []
        for row, (seq, start) in enumerate(zip(row_seqs[:nd], start_list)):  # a decode's one new token
            tokens = seq.token_ids
            if start < len(tokens):
                decode_ids.append(tokens[start])
            elif drafts is not None and row in drafts:  # a draft of a verification run as decodes
                decode_ids.append(drafts[row])
            else:  # sampled by the step in flight: read on the device
                decode_ids.append(0)
                in_flight_rows.append(row)
                in_flight_sampled.append(seq.sample_row)
        input_ids[:nd] = decode_ids
        num_in_flight = len(in_flight_rows)
        self.in_flight_rows.host[:num_in_flight] = in_flight_rows
        self.in_flight_sampled.host[:num_in_flight] = in_flight_sampled
        num_blocks = 0
        written = self._rows
        for row, seq in enumerate(row_seqs):
            table = seq.block_table
            held = written[row]
            if held is None or held[0] is not table:
                block_tables[row, :len(table)] = table
                written[row] = (table, len(table))
            elif held[1] != len(table):  # tables only grow in place: write the new blocks
                block_tables[row, held[1]:len(table)] = table[held[1]:]
                written[row] = (table, len(table))
            if row == 0 or row_seqs[row - 1] is not seq:  # a verification's rows count once
                num_blocks += len(table)
            if row >= nd:  # a prefill chunk or verification (rows are the step's entries here)
                s = sched[row]
                start = int(starts[row])
                ids = seq.token_ids[start:start + s.num_new_tokens]
                input_ids[qsl[row]:qsl[row + 1]] = ids + s.spec_token_ids if s.spec_token_ids else ids
        input_ids[num_real_tokens:] = 0
        rows = np.repeat(np.arange(num_seqs), query_lens)
        positions = self.positions.host[:num_tokens]
        positions[:num_real_tokens] = np.arange(num_real_tokens) - np.repeat(qsl[:num_seqs] - starts, query_lens)
        positions[num_real_tokens:] = 0
        slots = self.slot_mapping.host[:num_tokens]
        real = positions[:num_real_tokens]
        slots[:num_real_tokens] = block_tables[rows, real // bs].astype(np.int64) * bs + real % bs
        slots[num_real_tokens:] = -1
        sample_rows_np = np.asarray(sample_rows, dtype=np.int64)
        back = np.asarray(sample_back, dtype=np.int64)
        self.logits_indices.host[:num_sampled] = qsl[sample_rows_np + 1] - 1 - back
        self.sample_positions.host[:num_sampled] = seq_lens[sample_rows_np] - back
        # the prefill entries' rows (rows are the entries here unless run as decodes)
        prompt_chunks = () if as_decodes else tuple((int(qsl[i]), int(qsl[i + 1])) for i in range(nd, len(sched))
                                                    if not sched[i].spec_token_ids)
        self._shape = _StepShape(
            num_tokens=num_tokens, num_rows=num_rows, num_sampled=num_sampled, num_decodes=nd + num_rows - num_seqs,
            max_query_len=int(query_lens[nd:].max()) if num_seqs > nd else 0,
            max_seq_len=int(seq_lens.max()) if num_rows else 0,
            max_decode_seq_len=max_decode_seq_len or (int(seq_lens[:nd].max()) if nd else 0),
            num_in_flight=num_in_flight)
        num_used = sum(s.num_computed_after for s in sched) if as_decodes else int(seq_lens[:num_seqs].sum())
        return self._upload_all(sampled, num_used, num_blocks * bs, prompt_chunks)

    def pack(self) -> np.ndarray:
        """The last prepared step's inputs as one int64 array, for :meth:`load` in another rank."""
        shape = self._shape
        t, r, n, f = shape.num_tokens, shape.num_rows, shape.num_sampled, shape.num_in_flight
        width = cdiv(int(self.seq_lens.host[:r].max()), self.block_size) if r else 0
        return np.concatenate([
            np.array([*dataclasses.astuple(shape), width], dtype=np.int64),
            self.input_ids.host[:t], self.positions.host[:t], self.slot_mapping.host[:t],
            self.seq_lens.host[:r], self.query_start_loc.host[:r + 1], self.block_tables.host[:r, :width].ravel(),
            self.logits_indices.host[:n], self.in_flight_rows.host[:f], self.in_flight_sampled.host[:f],
        ], dtype=np.int64)

    def load(self, packed: np.ndarray) -> StepInputs:
        """Fill the buffers from :meth:`pack`'s array and copy them to the device: the same step
        as the rank that packed it, for its forward and logits only (``sampled`` is empty and
        ``sample_positions`` unset: another rank samples)."""
        fields = len(dataclasses.fields(_StepShape))
        shape = _StepShape(*(int(v) for v in packed[:fields]))
        width = int(packed[fields])
        t, r, n, f = shape.num_tokens, shape.num_rows, shape.num_sampled, shape.num_in_flight
        if r > self.max_num_seqs or max(t, n) > self.max_num_tokens:
            self._allocate(max(self.max_num_tokens, t, n), max(self.max_num_seqs, r))
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._rows = [None] * self.max_num_seqs  # rows written here, not from sequences' tables
        offset = fields + 1
        for buffer, count in ((self.input_ids, t), (self.positions, t), (self.slot_mapping, t), (self.seq_lens, r),
                              (self.query_start_loc, r + 1)):
            buffer.host[:count] = packed[offset:offset + count]
            offset += count
        self.block_tables.host[:r, :width] = packed[offset:offset + r * width].reshape(r, width)
        offset += r * width
        for buffer, count in ((self.logits_indices, n), (self.in_flight_rows, f), (self.in_flight_sampled, f)):
            buffer.host[:count] = packed[offset:offset + count]
            offset += count
        self._shape = shape
        return self._upload_all([], 0, 0)

    def _upload_all(self, sampled: list[Sequence], num_kv_slots_used: int, num_kv_slots_allocated: int,
                    prompt_chunks: tuple[tuple[int, int], ...] = ()) -> StepInputs:
        """Copy the host arrays of the step described by ``self._shape`` to the device."""
        shape = self._shape
        t, r, n, f = shape.num_tokens, shape.num_rows, shape.num_sampled, shape.num_in_flight
        if self._device is not self._staging:
            end = self._tables_offset + r * self.max_blocks_per_seq * torch.int32.itemsize
            self._device[:end].copy_(self._staging[:end], non_blocking=True)  # pinned: an asynchronous DMA
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping.device[:t],
            block_tables=self.block_tables.device[:r],
            seq_lens=self.seq_lens.device[:r],
            query_start_loc=self.query_start_loc.device[:r + 1],
            num_decodes=shape.num_decodes,
            max_query_len=shape.max_query_len,
            max_seq_len=shape.max_seq_len,
            max_decode_seq_len=shape.max_decode_seq_len,
            num_kv_splits=self.fixed_kv_splits,
        )
        inputs = StepInputs(
            input_ids=self.input_ids.device[:t],
            positions=self.positions.device[:t],
            metadata=metadata,
            sampled=sampled,
            logits_indices=self.logits_indices.device[:n],
            sample_positions=self.sample_positions.device[:n],
            num_kv_slots_used=num_kv_slots_used,
            num_kv_slots_allocated=num_kv_slots_allocated,
            in_flight=(self.in_flight_rows.device[:f], self.in_flight_sampled.device[:f]) if f else None,
            prompt_chunks=prompt_chunks,
        )
        if self.device.type == "cuda":
            self._uploaded = self._uploaded or torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.device))
        return inputs
