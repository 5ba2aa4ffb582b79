"""A step's input tensors: what the kernels read, padding rows for CUDA graphs, growth."""

import numpy as np
import pytest
import torch

from engine.runner.input_buffers import InputBuffers
from engine.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence

BS = 4


def _seq(name, token_ids, num_computed, table, forks=0):
    seq = Sequence(name, 0, list(token_ids), len(token_ids), SamplingParams(), arrival=0)
    seq.num_computed_tokens = num_computed
    seq.block_table = list(table)
    seq.forks = [Sequence(name, i + 1, list(token_ids), len(token_ids), SamplingParams(), 0) for i in range(forks)]
    return seq


def _mixed_step():
    """Two decodes (contexts 5 and 9), then a chunk of 3 of a 6-token prompt that stops short,
    and the 2-token rest of a prompt with 2 forks."""
    d0 = _seq("d0", range(10, 16), 5, [7, 3])
    d1 = _seq("d1", range(20, 30), 9, [1, 8, 2])
    p0 = _seq("p0", range(30, 36), 0, [5, 6])
    p1 = _seq("p1", range(40, 46), 4, [9, 4], forks=2)
    sched = [ScheduledSequence(d0, 1), ScheduledSequence(d1, 1), ScheduledSequence(p0, 3), ScheduledSequence(p1, 2)]
    sched[3].forks = p1.forks  # the scheduler moves them to the step that completes the prompt
    return SchedulerOutput(scheduled=sched, num_decodes=2), (d0, d1, p0, p1)


def test_mixed_step_inputs():
    step, (d0, d1, _, p1) = _mixed_step()
    inputs = InputBuffers(16, 2, 4, BS, torch.device("cpu")).prepare(step)
    assert inputs.input_ids.tolist() == [15, 29, 30, 31, 32, 44, 45]
    assert inputs.positions.tolist() == [5, 9, 0, 1, 2, 4, 5]
    md = inputs.metadata
    assert md.slot_mapping.tolist() == [3 * BS + 1, 2 * BS + 1, 5 * BS, 5 * BS + 1, 5 * BS + 2, 4 * BS, 4 * BS + 1]
    assert md.seq_lens.tolist() == [6, 10, 3, 6]
    assert md.query_start_loc.tolist() == [0, 1, 2, 5, 7]
    assert md.block_tables[:, :3].tolist()[1] == [1, 8, 2] and md.block_tables[3, :2].tolist() == [9, 4]
    assert md.block_tables.shape == (4, 4)  # grown past 2 rows, width fixed
    assert (md.num_decodes, md.max_query_len, md.max_seq_len, md.max_decode_seq_len) == (2, 3, 10, 10)
    # p0 stops short of its prompt's end: it samples nothing; p1's forks sample from its row.
    assert inputs.sampled == [d0, d1, p1, *p1.forks]
    assert inputs.logits_indices.tolist() == [0, 1, 6, 6, 6]
    assert inputs.sample_positions.tolist() == [6, 10, 6, 6, 6]
    assert (inputs.num_kv_slots_used, inputs.num_kv_slots_allocated) == (6 + 10 + 3 + 6, 9 * BS)
    assert inputs.prompt_chunks == ((2, 5), (5, 7))  # the rows of p0 and of p1


def test_padding_rows_write_nothing_and_attend_to_nothing():
    d0 = _seq("d0", range(10, 16), 5, [7, 3])
    step = SchedulerOutput(scheduled=[ScheduledSequence(d0, 1)], num_decodes=1)
    buffers = InputBuffers(8, 8, 4, BS, torch.device("cpu"))
    buffers.prepare(_mixed_step()[0])  # stale values in the buffers
    inputs = buffers.prepare(step, pad_to=4, max_decode_seq_len=16)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [15, 0, 0, 0] and inputs.positions.tolist() == [5, 0, 0, 0]
    assert md.slot_mapping.tolist() == [3 * BS + 1, -1, -1, -1]
    assert md.seq_lens.tolist() == [6, 0, 0, 0]
    assert inputs.prompt_chunks == ()
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert (md.num_decodes, md.max_query_len, md.max_decode_seq_len) == (4, 0, 16)
    assert inputs.sampled == [d0] and inputs.logits_indices.tolist() == [0]


def _verify_step():
    """A decode (context 5) and a verification of 2 drafts [91, 92] after a context of 6."""
    d0 = _seq("d0", range(10, 16), 5, [7, 3])
    v0 = _seq("v0", range(20, 27), 6, [1, 8, 2])
    return SchedulerOutput(scheduled=[ScheduledSequence(d0, 1), ScheduledSequence(v0, 3, [91, 92])],
                           num_decodes=1), (d0, v0)


def test_a_verification_among_decodes_runs_as_one_decode_row_per_token():
    step, (d0, v0) = _verify_step()
    assert step.verifies_as_decodes
    inputs = InputBuffers(8, 8, 4, BS, torch.device("cpu")).prepare(step, pad_to=8, max_decode_seq_len=16)
    md = inputs.metadata
    assert inputs.input_ids.tolist()[:4] == [15, 26, 91, 92]
    assert inputs.positions.tolist()[:4] == [5, 6, 7, 8]
    assert md.slot_mapping.tolist()[:5] == [3 * BS + 1, 8 * BS + 2, 8 * BS + 3, 2 * BS, -1]
    assert md.seq_lens.tolist()[:5] == [6, 7, 8, 9, 0]  # each row sees the drafts before its own
    assert md.block_tables[1:4, :3].tolist() == [[1, 8, 2]] * 3
    assert (md.num_decodes, md.max_query_len) == (8, 0)
    assert inputs.sampled == [d0, v0, v0, v0]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3]
    assert inputs.sample_positions.tolist() == [6, 7, 8, 9]
    assert (inputs.num_kv_slots_used, inputs.num_kv_slots_allocated) == (6 + 9, 5 * BS)
    assert inputs.prompt_chunks == ()


def test_a_verification_beside_a_prefill_chunk_is_one_multi_token_row():
    step, (d0, v0) = _verify_step()
    p0 = _seq("p0", range(30, 36), 0, [5, 6])
    step.scheduled.append(ScheduledSequence(p0, 3))
    assert not step.verifies_as_decodes
    inputs = InputBuffers(16, 8, 4, BS, torch.device("cpu")).prepare(step)
    assert inputs.input_ids.tolist() == [15, 26, 91, 92, 30, 31, 32]
    assert inputs.metadata.seq_lens.tolist() == [6, 9, 3]
    assert inputs.sampled == [d0, v0, v0, v0] and inputs.logits_indices.tolist() == [0, 1, 2, 3]
    assert inputs.prompt_chunks == ((4, 7),)  # the verification's rows are not a prompt's
    step.scheduled[1:] = step.scheduled[:0:-1]  # a prompt chunk before a verification
    assert InputBuffers(16, 8, 4, BS, torch.device("cpu")).prepare(step).prompt_chunks == ((1, 4),)


def test_padding_a_step_with_prefill_is_refused():
    with pytest.raises(ValueError, match="pad_to"):
        InputBuffers(16, 8, 4, BS, torch.device("cpu")).prepare(_mixed_step()[0], pad_to=8)


def test_buffers_keep_their_tensors_while_they_fit():
    buffers = InputBuffers(16, 8, 4, BS, torch.device("cpu"))
    ids = buffers.input_ids.device
    buffers.prepare(_mixed_step()[0])
    assert buffers.input_ids.device is ids
    assert np.shares_memory(buffers.input_ids.host, buffers.input_ids.device.numpy())  # the CPU needs no copy


def test_rows_follow_block_table_changes_between_steps():
    step, (d0, *_) = _mixed_step()
    buffers = InputBuffers(16, 8, 4, BS, torch.device("cpu"))
    buffers.prepare(step)
    d0.block_table[1] = 11  # copy-on-write replaced the block being written
    step.scheduled[1], step.scheduled[0] = step.scheduled[0], step.scheduled[1]  # rows trade places
    md = buffers.prepare(step).metadata
    assert md.block_tables[0, :3].tolist() == [1, 8, 2] and md.block_tables[1, :2].tolist() == [7, 11]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_copy_brings_every_input_to_the_gpu():
    """The device inputs equal the CPU's, for a step of four rows and then a padded one of two
    (the copy ends with the step's last block-table row)."""
    cpu = InputBuffers(16, 8, 4, BS, torch.device("cpu"))
    gpu = InputBuffers(16, 8, 4, BS, torch.device("cuda"))
    d0 = _seq("d0", range(10, 16), 5, [7, 3])
    single = SchedulerOutput(scheduled=[ScheduledSequence(d0, 1)], num_decodes=1)
    for step, pad_to in ((_mixed_step()[0], None), (single, 2)):
        want, got = cpu.prepare(step, pad_to=pad_to), gpu.prepare(step, pad_to=pad_to)
        for name in ("input_ids", "positions", "logits_indices", "sample_positions"):
            assert getattr(got, name).device.type == "cuda"
            assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
        for name in ("slot_mapping", "seq_lens", "query_start_loc"):
            assert getattr(got.metadata, name).tolist() == getattr(want.metadata, name).tolist(), name
        tables = [s.seq.block_table for s in step.scheduled]
        assert [row[:len(t)] for row, t in zip(got.metadata.block_tables.tolist(), tables)] == tables
