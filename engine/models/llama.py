"""Llama-family decoder over a paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

Token-flattened like vLLM: a step's sequences are concatenated into one ``[num_tokens]``
batch with no padding; ``positions`` place each token in its sequence and the
:class:`AttentionMetadata` tells attention which tokens belong together. q/k/v and gate/up
are fused into one matmul each (``qkv_proj``, ``gate_up_proj``); parameter names otherwise
follow HF so that checkpoints map one-to-one (see :data:`FUSED_PARAMS`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.runner.attention import AttentionMetadata, PagedAttentionBackend
from engine.runner.kv_cache import KVCache
from engine.layers.activation import silu_and_mul
from engine.layers.linear import BatchInvariantLinear, PackedLinear, replace_linears
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary_emb
from engine.loading.model_config import ModelConfig

# Our fused projection -> the HF projections stacked in it, in row order (see `shard_sizes`).
FUSED_PARAMS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k RMSNorm (Qwen3), RoPE, paged attention, output projection.

    The projections and :meth:`attention` are called one by one by :meth:`LlamaModel.piece`, so
    that everything but :meth:`attention` can be captured in CUDA graphs."""

    def __init__(self, config: ModelConfig, attn_backend: PagedAttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn_backend = attn_backend

    def shard_sizes(self) -> list[int]:
        """Rows of ``qkv_proj`` taken by q, k and v."""
        return [self.q_size, self.kv_size, self.kv_size]

    def attention(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The fused projection ``qkv`` ``[T, (Hq + 2 Hkv) * D]`` -> the heads' attention output
        ``[T, Hq * D]`` (before ``o_proj``): q/k norms, RoPE, this step's K/V written to the cache,
        paged attention. ``rope`` is the step's ``(cos, sin)`` from :class:`RotaryEmbedding`."""
        num_tokens = qkv.shape[0]
        if not self.qk_norm:
            out = self.attn_backend.rope_attention(qkv, rope, k_cache, v_cache, metadata, self.num_heads,
                                                   self.scale)
            if out is not None:
                return out
        q, k, v = qkv.split(self.shard_sizes(), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, k, *rope)
        out = self.attn_backend.forward(q, k, v, k_cache, v_cache, metadata, self.scale)
        return out.view(num_tokens, self.q_size)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def shard_sizes(self) -> list[int]:
        """Rows of ``gate_up_proj`` taken by gate and up."""
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``, residual adds fused into
    the norms; run by :class:`LlamaModel` piece by piece."""

    def __init__(self, config: ModelConfig, attn_backend: PagedAttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Embedding, ``num_hidden_layers`` decoder layers, final RMSNorm."""

    def __init__(self, config: ModelConfig, attn_backend: PagedAttentionBackend) -> None:
        super().__init__()
        # Given its (uninitialized) weight, the embedding skips its random init: the loader
        # overwrites it anyway, and on the meta device that init imported torch._dynamo (2-3 s).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def num_pieces(self) -> int:
        """Pieces of a forward between its attentions: one more than the layers."""
        return len(self.layers) + 1

    def piece(self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run piece ``index`` of the forward: everything between layer ``index - 1``'s attention
        and layer ``index``'s (vLLM's piecewise split). Every op in it is row-wise (a token's
        output depends on its own row only), so a batch padded with extra rows leaves the real
        rows' outputs as they are.

        Args:
            index: ``0`` takes the embedded tokens, ``1 .. L - 1`` layer ``index - 1``'s attention
                output ``[T, Hq * D]``, ``L`` (:attr:`num_pieces` - 1) the last layer's.
            hidden: that input.
            residual: ``[T, hidden_size]`` the residual stream so far (``None`` for piece 0).

        Returns:
            ``(qkv, residual)``: layer ``index``'s fused QKV projection ``[T, (Hq + 2 Hkv) * D]``
            and the residual stream, or for the last piece ``(final-normed hidden, None)``.
        """
        if index > 0:
            layer = self.layers[index - 1]
            hidden, residual = layer.post_attention_layernorm(layer.self_attn.o_proj(hidden), residual)
            hidden = layer.mlp(hidden)
        if index == len(self.layers):
            return self.norm(hidden, residual)[0], None
        layer = self.layers[index]
        if residual is None:
            hidden, residual = layer.input_layernorm(hidden), hidden
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        return layer.self_attn.qkv_proj(hidden), residual

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        run_piece: Callable[[int, torch.Tensor, torch.Tensor | None],
                            tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ) -> torch.Tensor:
        """Embed, then run each :meth:`piece` through ``run_piece`` (default: the method itself;
        :mod:`engine.runner.piecewise_graphs` replays CUDA graphs of them) with each layer's attention
        between two pieces."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        rope = self.rotary_emb(positions, hidden.dtype)
        run_piece = run_piece or self.piece
        residual = None
        for i, layer in enumerate(self.layers):
            qkv, residual = run_piece(i, hidden, residual)
            hidden = layer.self_attn.attention(rope, qkv, *kv_cache.layer(i), metadata)
        return run_piece(len(self.layers), hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    Args:
        config: the architecture.
        attn_backend: the paged attention every layer calls.

    Raises:
        ValueError: ``config.rope_scaling`` has an unsupported type.

    Parameters are created on the default device in the default dtype; build it in the
    target dtype (or on the meta device, then :meth:`materialize`) rather than ``.to(dtype)``
    afterwards, which would also cast the float32 RoPE table. With tied embeddings there is
    no ``lm_head`` and the logits reuse ``model.embed_tokens.weight``.
    """

    def __init__(self, config: ModelConfig, attn_backend: PagedAttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        run_piece: Callable[[int, torch.Tensor, torch.Tensor | None],
                            tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ) -> torch.Tensor:
        """Run one step over a flattened batch and write its K/V into ``kv_cache``.

        Args:
            input_ids: ``[num_tokens]`` int64, decode tokens first, then prefill chunks.
            positions: ``[num_tokens]`` int64 position of each token in its sequence.
            kv_cache: the worker's cache; ``metadata.slot_mapping`` says where each token goes.
            metadata: the step's attention metadata.
            run_piece: runs :meth:`LlamaModel.piece` (its arguments and results), e.g. by
                replaying a CUDA graph of it; default: the method itself.

        Returns:
            ``[num_tokens, hidden_size]`` final-normed hidden states in the model dtype.
        """
        return self.model(input_ids, positions, kv_cache, metadata, run_piece)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, hidden_size]`` (the rows to sample from) -> ``[n, vocab_size]`` float32 logits."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def replace_linears(self, layer: type[PackedLinear] | type[BatchInvariantLinear]) -> None:
        """Run every projection, the logits head included, through ``layer``
        (:mod:`engine.layers.linear`: oneDNN-packed weights for a float32 CPU model, the
        batch-invariant matmul on CUDA). Call once, after loading."""
        if self.lm_head is None:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight
        replace_linears(self, layer)

    def materialize(self, device: torch.device | str) -> None:
        """Allocate (uninitialised) parameters on ``device`` for a model built on the meta device,
        and compute its RoPE table there. (``torch.empty`` per tensor rather than
        ``Module.to_empty``: its ``empty_like`` of a meta tensor runs PyTorch's Python reference
        implementation, 0.6 s of imports at first use.)"""
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                   requires_grad=param.requires_grad))
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
        self.model.rotary_emb.build_cache(device)
