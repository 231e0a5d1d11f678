"""The Llama-family decoder (Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3) over a flattened
varlen batch and a paged KV cache, as a composition of ``pipeline.layers``.

Owns the weights only (as fused projections: one q/k/v matmul and one gate/up matmul per
layer); the KV cache tensors and the batch metadata belong to the model runner and are
passed in on every forward. Two forwards compute the same math: on CPU in float32 the fused
decoder of ``layers.fused_decoder`` (four element-wise C calls per layer, a C GEMV for small
batches), elsewhere (CUDA, half types) the layers below one op at a time in torch, whose
rounding sequence matches transformers'. On CPU the projections and the embedding may be
packed as bfloat16, int8 (``layers.lowp``) or int4 (``layers.int4``) under float32 activations.
The model is built on the meta device; ``models.weights.WeightPlan.finalize`` puts each
parameter in its final form (packed, transposed, or as is) as the loader completes it.
Under tensor parallelism (``models.parallel``) the model is built from the rank's shard of
the config and holds the rank's slices; ``tp`` sums the o/down projections and the embedding
lookup over the ranks and gathers the logits.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.layers import flash_prefill, ops, ops_cuda, ops_fused
from pipeline.layers.attention import AttentionMetadata
from pipeline.layers.fused_decoder import forward_fused
from pipeline.layers.int4 import PACKED
from pipeline.layers.norm import RMSNorm
from pipeline.layers.rotary import RotaryEmbedding
from pipeline.models.config import ModelArch, rope_inv_freq
from pipeline.models.parallel import TPGroup


def _empty(*shape: int) -> nn.Parameter:
    # Placeholders (on the meta device) that the loader replaces; no initialisation work.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _bias(enabled: bool, n: int) -> nn.Parameter | None:
    return _empty(n) if enabled else None


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kn: bool) -> torch.Tensor:
    """x @ W^T + b with W stored [out, in] (kn=False) or pre-transposed [in, out] (kn=True)."""
    return ops_fused.linear(x, w, b, kn)


PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArch) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.scale = c.head_dim ** -0.5
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_weight = _empty(c.q_size + 2 * c.kv_size, c.hidden_size)
        self.qkv_bias = _bias(c.qkv_bias, c.q_size + 2 * c.kv_size)
        self.o_weight = _empty(c.hidden_size, c.q_size)
        self.o_bias = _bias(c.o_bias, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.intermediate_size = c.intermediate_size
        self.gate_up_weight = _empty(2 * c.intermediate_size, c.hidden_size)
        self.gate_up_bias = _bias(c.mlp_bias, 2 * c.intermediate_size)
        self.down_weight = _empty(c.hidden_size, c.intermediate_size)
        self.down_bias = _bias(c.mlp_bias, c.hidden_size)
        self.kn = False  # projections stored [in, out] (set by models.weights when it loads them so)

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  on_kv_written: Callable[[], None] | None) -> torch.Tensor:
        t = h.shape[0]
        qkv = _linear(h, self.qkv_weight, self.qkv_bias, self.kn)
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        # One rotation for q and k together; q and k are views of its result.
        qk = ops_cuda.rotary_(qk, cos, sin) if ops_cuda.enabled(qk) else RotaryEmbedding.apply(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if on_kv_written is not None:
            on_kv_written()
        if meta.prefill is not None:
            o = flash_prefill.attention(q, k_cache, v_cache, meta.prefill, self.scale)
        else:
            o = ops.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                    meta.block_tables, self.scale)
        return _linear(o.view(t, self.q_size), self.o_weight, self.o_bias, self.kn)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate_up = _linear(h, self.gate_up_weight, self.gate_up_bias, self.kn)
        if ops_cuda.enabled(gate_up):
            return _linear(ops_cuda.silu_mul(gate_up), self.down_weight, self.down_bias, self.kn)
        act = F.silu(gate_up[:, :self.intermediate_size]).mul_(gate_up[:, self.intermediate_size:])
        return _linear(act, self.down_weight, self.down_bias, self.kn)


class CausalLM(nn.Module):
    """The whole decoder; ``forward`` returns final hidden states, ``compute_logits`` logits."""

    def __init__(self, config: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _empty(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else \
            _empty(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions,
                                      functools.partial(rope_inv_freq, config.rope, config.head_dim))
        self.lm_head_kn = False  # an untied lm_head stored [hidden, vocab] (models.weights)
        self.tp: TPGroup | None = None  # set by the model runner under tensor parallelism

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        outside = None
        if tp is not None:  # this rank's rows of the vocabulary; the others' sum in
            input_ids = input_ids - tp.shard.vocab_start
            outside = (input_ids < 0) | (input_ids >= tp.shard.vocab_per_rank)
            input_ids = input_ids.masked_fill(outside, 0)
        if isinstance(self.embed_tokens, PACKED):
            x = self.embed_tokens.embed(input_ids)
        else:
            x = F.embedding(input_ids, self.embed_tokens)
        if tp is not None:
            assert outside is not None
            tp.all_reduce(x.masked_fill_(outside[:, None], 0))
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                on_kv_written: Callable[[int], None] | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        if x.dtype == torch.float32 and x.device.type == "cpu" and ops.backend(x.device) is not None:
            return forward_fused(self, x, positions, meta, kv_caches, on_kv_written)
        cos, sin = self.rotary.table(positions, x.dtype)
        # CUDA half types: each residual add rides in the next norm's kernel (x in place).
        fused = ops_cuda.enabled(x)
        pending: torch.Tensor | None = None  # the last MLP's output, not yet added to x
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[i]
            signal = (lambda i=i: on_kv_written(i)) if on_kv_written is not None else None
            if fused:
                h = ops_cuda.add_rms_norm(x, pending, layer.input_layernorm)
            else:
                x = x if pending is None else x + pending
                h = layer.input_layernorm(x)
            a = layer.attention(h, cos, sin, k_cache, v_cache, meta, signal)
            a = a if self.tp is None else self.tp.all_reduce(a)
            if fused:
                h = ops_cuda.add_rms_norm(x, a, layer.post_attention_layernorm)
            else:
                x = x + a
                h = layer.post_attention_layernorm(x)
            m = layer.mlp(h)
            pending = m if self.tp is None else self.tp.all_reduce(m)
        return x if pending is None else x + pending

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm of ``forward``'s hidden states (what lm_head and pooling take)."""
        if hidden.dtype == torch.float32 and hidden.device.type == "cpu":
            return ops_fused.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given final hidden states [N, hidden] -> [N, vocab]."""
        logits = _linear(self.final_norm(hidden), self.lm_head, None, self.lm_head_kn).float()
        if self.tp is not None:  # every rank gets the full row
            logits = self.tp.all_gather_cols(logits)[:, :self.tp.shard.vocab_size]
        return logits
