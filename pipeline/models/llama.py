"""Worker stage: the Llama-family decoder (Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3) over a
flattened varlen batch and a paged KV cache.

Owns the weights only (as fused projections: one q/k/v matmul and one gate/up matmul per
layer); the KV cache tensors and the batch metadata belong to the model runner and are
passed in on every forward. Two forwards compute the same math: on CPU in float32 one over
the fused C ops (``ops_fused``: four element-wise calls per layer, a C GEMV for small
batches), elsewhere (CUDA, half types) one op by op in torch, whose rounding sequence
matches transformers'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.config import ModelConfig, rope_inv_freq
from pipeline.worker import ops, ops_fused


@dataclass(slots=True)
class AttentionMetadata:
    """What paged attention needs for one step (all tensors on the model's device)."""
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, M] int32


def _empty(*shape: int) -> nn.Parameter:
    # Weights are overwritten by the loader; skip initialisation work.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _bias(enabled: bool, n: int) -> nn.Parameter | None:
    return _empty(n) if enabled else None


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kn: bool) -> torch.Tensor:
    """x @ W^T + b with W stored [out, in] (kn=False) or pre-transposed [in, out] (kn=True)."""
    return ops_fused.linear(x, w, b, kn)


_PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _empty(dim)
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # transformers normalises in float32 and casts back before the weight multiply.
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a cos/sin table over every usable position.

    Tables are stored full-width as ``cos = [c, c]`` and ``sin = [-s, s]`` so that
    ``x * cos + roll(x, D/2) * sin`` is rotate-half RoPE in four ops."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = config.rope, config.head_dim, max_positions
        half = config.head_dim // 2
        self.register_buffer("cos", torch.empty(max_positions, 2 * half), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, 2 * half), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the float32 tables on the buffers' device (after ``to_empty``)."""
        if self.cos.is_meta:
            return
        dev = self.cos.device
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(dev)
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device=dev)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        self.cos, self.sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)
        return torch.addcmul(x * cos, rotated, sin)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
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
        self.kn = False  # projections pre-transposed to [in, out] (see CausalLM.transpose_weights)

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  on_kv_written: Callable[[], None] | None) -> torch.Tensor:
        t = h.shape[0]
        qkv = _linear(h, self.qkv_weight, self.qkv_bias, self.kn)
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        # One rotation for q and k together; q and k are views of its result.
        qk = RotaryEmbedding.apply(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if on_kv_written is not None:
            on_kv_written()
        o = ops.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                meta.block_tables, self.scale)
        return _linear(o.view(t, self.q_size), self.o_weight, self.o_bias, self.kn)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate_up = _linear(h, self.gate_up_weight, self.gate_up_bias, self.kn)
        act = F.silu(gate_up[:, :self.intermediate_size]).mul_(gate_up[:, self.intermediate_size:])
        return _linear(act, self.down_weight, self.down_bias, self.kn)


class CausalLM(nn.Module):
    """The whole decoder; ``forward`` returns final hidden states, ``compute_logits`` logits."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _empty(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else \
            _empty(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.lm_head_kn = False

    @torch.no_grad()
    def transpose_weights(self) -> None:
        """Store projections as [in, out]: on CPU, MKL's GEMV/small-M GEMM reads a
        pre-transposed matrix markedly faster (decode is bandwidth-bound). A tied lm_head stays
        [vocab, hidden] since the embedding lookup shares it."""
        for layer in self.layers:
            if layer.kn:
                continue
            for name in _PROJECTIONS:
                setattr(layer, name, nn.Parameter(getattr(layer, name).t().contiguous(), requires_grad=False))
            layer.kn = True
        if not self.config.tie_word_embeddings and not self.lm_head_kn:
            self.lm_head = nn.Parameter(self.lm_head.t().contiguous(), requires_grad=False)
            self.lm_head_kn = True

    def tie_weights(self) -> None:
        """Re-share lm_head with the embedding (module moves can split shared parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head = self.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                on_kv_written: Callable[[int], None] | None = None) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        if x.dtype == torch.float32 and x.device.type == "cpu" and ops.backend(x.device) is not None:
            return self._forward_fused(x, positions, meta, kv_caches, on_kv_written)
        cos, sin = self.rotary.table(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[i]
            signal = (lambda i=i: on_kv_written(i)) if on_kv_written is not None else None
            x = x + layer.attention(layer.input_layernorm(x), cos, sin, k_cache, v_cache, meta, signal)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       on_kv_written: Callable[[int], None] | None) -> torch.Tensor:
        """The CPU float32 path: the same math as the per-op path below, with each layer's
        element-wise work in four C calls (add + RMSNorm twice, RoPE + KV write, SwiGLU) and
        small-batch projections in the C GEMV, all writing into activation buffers allocated
        once per step. Layer 0 goes through the checked ``ops`` wrappers; every later layer
        has the same shapes, dtypes and metadata, so it calls the kernels directly (their
        index checks still run in C). At batch 1 this is most of what is left of a step
        besides reading the weights."""
        ext = ops.backend(x.device)
        layer0 = self.layers[0]
        t, hidden = x.shape
        qs, kvs, nh, nkv, hd = layer0.q_size, layer0.kv_size, layer0.num_heads, layer0.num_kv_heads, layer0.head_dim
        inter = layer0.intermediate_size
        gemv = 0 < t <= ops_fused.GEMV_MAX_M
        residual = x
        h, o, down = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        qkv = torch.empty((t, qs + 2 * kvs), dtype=torch.float32)
        attn = torch.empty((t, nh, hd), dtype=torch.float32)
        gate_up = torch.empty((t, 2 * inter), dtype=torch.float32)
        act = torch.empty((t, inter), dtype=torch.float32)
        rp, hp, op, dp = residual.data_ptr(), h.data_ptr(), o.data_ptr(), down.data_ptr()
        qkvp, ap, gup, actp = qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr()
        q = qkv[:, :qs].view(t, nh, hd)
        k = qkv[:, qs:qs + kvs].view(t, nkv, hd)
        v = qkv[:, qs + kvs:].view(t, nkv, hd)
        cos, sin = self.rotary.cos, self.rotary.sin
        slots = meta.slot_mapping
        posp, cosp, sinp, slp = positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        dcode = ops.dtype_code(kv_caches[0][0].dtype)
        nb, bs = kv_caches[0][0].shape[0], kv_caches[0][0].shape[1]
        cu, sl, bt = meta.cu_seqlens_q, meta.seq_lens, meta.block_tables
        cup, slp2, btp, nseq, maxb = cu.data_ptr(), sl.data_ptr(), bt.data_ptr(), sl.shape[0], bt.shape[1]

        def proj(inp: torch.Tensor, inp_ptr: int, w: torch.Tensor, b: torch.Tensor | None,
                 out: torch.Tensor, out_ptr: int, kn: bool) -> None:
            if gemv and kn:
                ext.gemv(out_ptr, out.shape[1], inp_ptr, inp.shape[1], w.data_ptr(),
                         0 if b is None else b.data_ptr(), t, inp.shape[1], out.shape[1], True)
            elif not kn:
                out.copy_(ops_fused.linear(inp, w, b, kn=False))
            elif b is None:
                torch.mm(inp, w, out=out)
            else:
                torch.addmm(b, inp, w, out=out)

        ops_fused.rms_norm(residual, layer0.input_layernorm.weight, layer0.input_layernorm.eps, out=h)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[i]
            proj(h, hp, layer.qkv_weight, layer.qkv_bias, qkv, qkvp, layer.kn)
            if layer.q_norm is not None or i == 0:
                lq, lk = (layer.q_norm(q), layer.k_norm(k)) if layer.q_norm is not None else (q, k)
                ops_fused.rope_and_cache(lq, lk, v, positions, cos, sin, k_cache, v_cache, slots)
                if on_kv_written is not None:
                    on_kv_written(i)
                ops.paged_attention(lq, k_cache, v_cache, cu, sl, bt, layer.scale, out=attn)
            else:
                bad = ext.rope_and_cache(qkvp, qkvp + 4 * qs, qkvp + 4 * (qs + kvs), q.stride(0),
                                         q.stride(0), q.stride(0), posp, cosp, sinp, cos.shape[0],
                                         k_cache.data_ptr(), v_cache.data_ptr(), slp, t, nh, nkv,
                                         hd, nb * bs, dcode)
                if bad >= 0:  # not reached after layer 0 passed; kept for a clear error
                    ops_fused.rope_and_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
                if on_kv_written is not None:
                    on_kv_written(i)
                bad = ext.paged_attention(ap, qkvp, k_cache.data_ptr(), v_cache.data_ptr(), cup,
                                          slp2, btp, nseq, t, q.stride(0), nh, nkv, hd, nb, bs,
                                          maxb, float(layer.scale), dcode)
                if bad != -1:
                    ops.paged_attention(q, k_cache, v_cache, cu, sl, bt, layer.scale, out=attn)
            proj(attn.view(t, qs), ap, layer.o_weight, layer.o_bias, o, op, layer.kn)
            post = layer.post_attention_layernorm
            ext.rms_norm(hp, op, rp, post.weight.data_ptr(), t, hidden, hidden, hidden, hidden, post.eps)
            proj(h, hp, layer.gate_up_weight, layer.gate_up_bias, gate_up, gup, layer.kn)
            ext.silu_and_mul(actp, gup, t, inter, 2 * inter)
            proj(act, actp, layer.down_weight, layer.down_bias, down, dp, layer.kn)
            if i < last:
                nxt = self.layers[i + 1].input_layernorm
                ext.rms_norm(hp, dp, rp, nxt.weight.data_ptr(), t, hidden, hidden, hidden, hidden, nxt.eps)
            else:
                residual.add_(down)
        return residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given final hidden states [N, hidden] -> [N, vocab]."""
        if hidden.dtype == torch.float32 and hidden.device.type == "cpu":
            hidden = ops_fused.rms_norm(hidden, self.norm.weight, self.norm.eps)
        else:
            hidden = self.norm(hidden)
        return _linear(hidden, self.lm_head, None, self.lm_head_kn).float()
