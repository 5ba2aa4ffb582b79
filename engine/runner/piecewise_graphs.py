"""Steps with prompt chunks run as CUDA graphs of the pieces between their attentions.

A decode-only step replays one graph of the whole forward (:mod:`engine.runner.cuda_graphs`), but a
step that carries a prompt chunk cannot: its attention's grid depends on how the step's tokens
fall into sequences. Run eagerly, such a step launches about ten kernels a layer, and on a
large GPU the host's launches are then the step's time (docs/engine.md, "CUDA graphs"), too long
for a decode worker that prefills to hold a 20 ms inter-token latency. As vLLM's piecewise CUDA graphs do, everything between two attentions
(:meth:`engine.models.llama.LlamaModel.piece`: ``o_proj``, the norms, the MLP, the next
``qkv_proj``, and the tensor-parallel all-reduces) is captured once per padded token count of
a ladder, and the attention (RoPE, the KV cache write, paged attention) runs eagerly between
two replays on the step's real tokens.

A step of ``n`` tokens runs at the smallest captured count ``T >= n``. The graphs read and
write fixed buffers of ``max(T)`` rows: the embedded tokens are copied into the first ``n`` rows
of an input buffer, each attention writes its output into those of another
(``AttentionMetadata.attn_out``), and a piece's outputs (the next layer's fused QKV projection
and the residual stream) land in output buffers. Rows ``n .. T`` hold
what an earlier step left there (zeros at first): every op of a piece is row-wise, so they
change no real row, and they never reach the attention, which reads rows ``:n`` only. Larger
steps run eagerly: from a few thousand tokens on, their matmuls outlast their launches anyway.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.runner.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.runner.cuda_graphs import round_up_table
from engine.runner.kv_cache import KVCache

logger = logging.getLogger(__name__)

# Default ladder: doublings up to LADDER_FINE tokens (a step that small reads the weights for
# longer than it computes, so its padding is nearly free), then LADDER_SUBSTEPS evenly spaced
# counts per doubling (padding under 1/LADDER_SUBSTEPS of a step's tokens), up to LADDER_TOP.
LADDER_FINE = 128
LADDER_SUBSTEPS = 8
LADDER_TOP = 2048


def piecewise_token_sizes(config: EngineConfig, device: torch.device) -> list[int]:
    """The padded token counts to capture: none off CUDA or with ``enforce_eager``; else
    ``config.cuda_graph_token_sizes`` or 16, 32, ..., ``LADDER_FINE``, then ``LADDER_SUBSTEPS``
    counts per doubling (144, 160, ..., 256, 288, ..., 512, 576, ...) up to
    ``min(max_num_batched_tokens, LADDER_TOP)`` (and that bound itself).

    Past a few hundred tokens a step's matmuls are bound by arithmetic, and its padded rows cost
    their share of its time while an eager step's launches hide behind its device work: eight
    counts per doubling keep the padding under 1/8 of a step; sixteen gained nothing measurable
    on an H200 and doubled the capture time (docs/engine.md, "Launches")."""
    if device.type != "cuda" or config.enforce_eager:
        return []
    if config.cuda_graph_token_sizes is not None:
        return list(config.cuda_graph_token_sizes)
    top = min(config.max_num_batched_tokens, LADDER_TOP)
    sizes = [16 << i for i in range(LADDER_FINE.bit_length()) if 16 << i <= LADDER_FINE]
    low = LADDER_FINE
    while low < top:
        step = low // LADDER_SUBSTEPS
        sizes += range(low + step, 2 * low + 1, step)
        low *= 2
    return sorted({s for s in sizes if s <= top} | {top})


class PiecewiseCUDAGraphs:
    """The captured pieces of one model's forward, at every padded token count of a ladder.

    Args:
        model: a ``LlamaForCausalLM``-like model whose ``model`` has ``piece`` and
            ``num_pieces``, and whose ``forward`` takes ``run_piece``.
        token_sizes: the ladder of padded token counts; any order, duplicates ignored.
        device: where the model runs.

    Use: :meth:`capture` once at start-up (CUDA), then per step :meth:`size_for` and
    :meth:`forward`. Until captured, :meth:`forward` runs the pieces eagerly on the same buffers
    (how they are warmed up, and measured by :mod:`engine.runner.profiling`).
    """

    def __init__(self, model: torch.nn.Module, token_sizes: list[int], device: torch.device) -> None:
        self.model = model
        self.token_sizes = sorted(set(token_sizes))
        self.max_num_tokens = self.token_sizes[-1]
        self.num_pieces = model.model.num_pieces
        config = model.config
        dtype = next(model.parameters()).dtype
        attention = model.model.layers[0].self_attn
        q_size, qkv_size = attention.q_size, sum(attention.shard_sizes())

        def buffer(width: int) -> torch.Tensor:
            return torch.zeros(self.max_num_tokens, width, dtype=dtype, device=device)

        self.embedded, self.attn_out = buffer(config.hidden_size), buffer(q_size)  # the pieces' inputs
        self.qkv, self.residual, self.hidden = buffer(qkv_size), buffer(config.hidden_size), buffer(config.hidden_size)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (token count, piece)
        self._size = self.max_num_tokens  # the token count of the step under way
        self._size_for = round_up_table(self.token_sizes)

    def size_for(self, num_tokens: int) -> int | None:
        """The padded token count that runs a step of ``num_tokens``, ``None`` past the ladder."""
        return self._size_for[num_tokens] if 0 < num_tokens <= self.max_num_tokens else None

    def _run_piece(self, index: int, size: int) -> None:
        """Piece ``index`` on the buffers' first ``size`` rows, its outputs into the output buffers."""
        first = index == 0
        out, residual = self.model.model.piece(index, (self.embedded if first else self.attn_out)[:size],
                                               None if first else self.residual[:size])
        if index == self.num_pieces - 1:
            self.hidden[:size].copy_(out)
        else:
            self.qkv[:size].copy_(out)
            self.residual[:size].copy_(residual)

    def _piece(self, index: int, hidden: torch.Tensor, _residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run_piece`` of the model's forward: ``hidden`` (``n`` rows) into the input buffer
        (unless the attention wrote it there: ``metadata.attn_out``), then the graph of ``(the
        step's size, index)`` (eagerly when not captured). The residual argument is the view of
        ``self.residual`` this returned before, so it is not copied."""
        n = hidden.shape[0]
        buffer = self.embedded if index == 0 else self.attn_out
        if hidden.data_ptr() != buffer.data_ptr():
            buffer[:n].copy_(hidden)
        graph = self.graphs.get((self._size, index))
        if graph is None:
            self._run_piece(index, self._size)
        else:
            graph.replay()
        if index == self.num_pieces - 1:
            return self.hidden[:n], None
        return self.qkv[:n], self.residual[:n]

    @torch.inference_mode()
    def forward(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        """The model's forward over a step of ``n = len(input_ids)`` tokens (the arguments of
        ``model.forward``) with its pieces padded to ``size`` rows (:meth:`size_for`); returns
        the final hidden states ``[n, hidden_size]``, a view of a buffer the next step overwrites.
        The attention writes its outputs straight into the pieces' input buffer."""
        self._size = size
        metadata = dataclasses.replace(metadata, attn_out=self.attn_out[:len(input_ids)])
        return self.model(input_ids, positions, kv_cache, metadata, run_piece=self._piece)

    @torch.inference_mode()
    def run_pieces(self, size: int) -> None:
        """Run every piece eagerly once at ``size`` rows on what the buffers hold (no attention
        between them): the warm-up before capture, and the graphs' memory peak for the profiler."""
        for index in range(self.num_pieces):
            self._run_piece(index, size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every piece at every token count, largest first into one memory pool (the
        pieces never run at the same time, and what one hands the next is in the buffers), each
        count's pieces run once eagerly first (compiling their kernels)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.token_sizes):
            self.run_pieces(size)
            torch.cuda.synchronize()
            for index in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._run_piece(index, size)
                graph.replay()  # the first replay uploads the graph
                self.graphs[size, index] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs of the %d pieces between attentions for steps of up to %d tokens",
                    len(self.graphs), self.num_pieces, self.max_num_tokens)
