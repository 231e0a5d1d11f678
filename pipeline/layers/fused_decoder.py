"""Layers: the CPU float32 decoder stack over the fused C ops.

Runs a Llama-family decoder (``models.llama.CausalLM``: its layers' weights, norms and
rotary tables) from embeddings to final hidden states with the fused CPU kernels
(``ops_fused``, ``cpu_ops``), writing into activation buffers allocated once per step.
The model calls it for float32 activations on CPU when the C ops are built; the projections
may be float32 or packed ``LowpWeight``s (bf16/int8) or ``Int4Weight``s. Owns no state.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from pipeline.layers import ops, ops_fused
from pipeline.layers.attention import AttentionMetadata
from pipeline.layers.int4 import PACKED
from pipeline.layers.lowp import LowpWeight, mlp_bf16


def forward_fused(model: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  on_kv_written: Callable[[int], None] | None) -> torch.Tensor:
    """The CPU float32 decoder of ``model`` (a ``models.llama.CausalLM``): the same math as
    its per-op forward, with each layer's
    element-wise work in four C calls (add + RMSNorm twice, RoPE + KV write, SwiGLU) and
    small-batch projections in the C GEMV, all writing into activation buffers allocated
    once per step. Layer 0 goes through the checked ``ops`` wrappers; every later layer
    has the same shapes, dtypes and metadata, so it calls the kernels directly (their
    index checks still run in C). At batch 1 this is most of what is left of a step
    besides reading the weights; so all layers run in one C call instead
    (``cpu_ops_decoder.h``: the same kernels in the same order, so the same floats) for as
    many tokens as its projections take (``_layer_table``), unless a layer needs Python
    (q/k norms, a layer-signal callback, the all-reduces of tensor parallelism)."""
    ext = ops.backend(x.device)
    assert ext is not None, "the model calls this only when the C ops are built"
    tp = model.tp  # tensor parallel: o and down are row-parallel, summed over the ranks
    layer0 = model.layers[0]
    t, hidden = x.shape
    qs, kvs, nh, nkv, hd = layer0.q_size, layer0.kv_size, layer0.num_heads, layer0.num_kv_heads, layer0.head_dim
    inter = layer0.intermediate_size
    gemv = 0 < t <= ops_fused.GEMV_MAX_M  # packed weights pick GEMV or AMX tiles in C alike
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
    cos, sin = model.rotary.cos, model.rotary.sin
    slots = meta.slot_mapping
    posp, cosp, sinp, slp = positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
    dcode = ops.dtype_code(kv_caches[0][0].dtype)
    nb, bs = kv_caches[0][0].shape[0], kv_caches[0][0].shape[1]
    cu, sl, bt = meta.cu_seqlens_q, meta.seq_lens, meta.block_tables
    cup, slp2, btp, nseq, maxb = cu.data_ptr(), sl.data_ptr(), bt.data_ptr(), sl.shape[0], bt.shape[1]

    def proj(inp: torch.Tensor, inp_ptr: int, w: torch.Tensor | nn.Module, b: torch.Tensor | None,
             out: torch.Tensor, out_ptr: int, kn: bool) -> None:
        if isinstance(w, PACKED):
            w.linear(inp, b, out)
        elif gemv and kn:
            ext.gemv(out_ptr, out.shape[1], inp_ptr, inp.shape[1], w.data_ptr(),
                     0 if b is None else b.data_ptr(), t, inp.shape[1], out.shape[1], True)
        elif not kn:
            out.copy_(ops_fused.linear(inp, w, b, kn=False))
        elif b is None:
            torch.mm(inp, w, out=out)
        else:
            torch.addmm(b, inp, w, out=out)

    ops_fused.rms_norm(residual, layer0.input_layernorm.weight, layer0.input_layernorm.eps, out=h)
    last = len(model.layers) - 1
    # Small batches: every layer in one C call (same kernels, same order). The buffers are
    # made here; the metadata's types and shapes are checked first and its values in C. A
    # value that fails there fails in layer 0, before the residual changes: the Python loop
    # then runs and raises the checked wrappers' error.
    entry = _layer_table(model, kv_caches) if t > 0 and on_kv_written is None and tp is None else None
    table = entry[0] if entry is not None and t <= entry[1] else None
    if table is not None:
        ops._check_metadata(cu, sl, bt, x.device)
        for name, idx in (("positions", positions), ("slot_mapping", slots)):
            ops._check_index(name, idx, torch.int64, 1, x.device)
            if idx.shape[0] != t:
                raise ValueError(f"{name} has {idx.shape[0]} entries for {t} tokens")
        rc = table.run(0, (t, hidden, qs, kvs, nh, nkv, hd, inter),
                       (rp, hp, op, dp, qkvp, ap, gup, actp), posp, slp, cosp, sinp,
                       cos.shape[0], nb * bs, dcode, cup, slp2, btp, nseq, nb, bs, maxb,
                       float(layer0.scale))
        if rc == -1:
            return residual
        # -2: some projection would not run in C for t rows; nothing was done, the loop runs
        if rc >= 4 or rc % 4 == 0:  # past layer 0, or out of memory: nothing to redo
            what = ("scratch memory", "RoPE/KV-cache index", "paged attention")[rc % 4]
            raise RuntimeError(f"decoder layer {rc // 4}: {what} failed")
    for i, layer in enumerate(model.layers):
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
                                      maxb, float(layer.scale), dcode, 0, 0)
            if bad != -1:
                ops.paged_attention(q, k_cache, v_cache, cu, sl, bt, layer.scale, out=attn)
        proj(attn.view(t, qs), ap, layer.o_weight, layer.o_bias, o, op, layer.kn)
        if tp is not None:
            tp.all_reduce(o)
        post = layer.post_attention_layernorm
        ext.rms_norm(hp, op, rp, post.weight.data_ptr(), t, hidden, hidden, hidden, hidden, post.eps)
        gu, dn = layer.gate_up_weight, layer.down_weight
        plain = layer.gate_up_bias is None and layer.down_bias is None
        if not (plain and isinstance(gu, LowpWeight) and isinstance(dn, LowpWeight)
                and mlp_bf16(h, gu, dn, down)):
            if layer.gate_up_bias is not None or not isinstance(gu, LowpWeight) or not gu.swiglu(h, act):
                proj(h, hp, gu, layer.gate_up_bias, gate_up, gup, layer.kn)
                ext.silu_and_mul(actp, gup, t, inter, 2 * inter)
            proj(act, actp, dn, layer.down_bias, down, dp, layer.kn)
        if tp is not None:
            tp.all_reduce(down)
        if i < last:
            nxt = model.layers[i + 1].input_layernorm
            ext.rms_norm(hp, dp, rp, nxt.weight.data_ptr(), t, hidden, hidden, hidden, hidden, nxt.eps)
        else:
            residual.add_(down)
    return residual


_FMT_CODE = {"bf16": 1, "int8": 2, "int4": 3}  # cpu_ops_decoder.h PIPE_W_*


def _layer_table(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """(the C layer table of ``model`` over ``kv_caches`` (cpu_ops.DecoderLayers), the most
    tokens it takes), built once and kept on the model; None when a layer needs the Python
    loop (q/k norms, or float32 projections not stored [in, out]). float32 projections run
    in the C GEMV (at most ``GEMV_MAX_M`` rows), int4 ones as far as their GEMV takes rows
    (``cpu_ops.linear_route``); bf16 and int8 any number (the GEMV or AMX tiles, as
    ``LowpWeight.linear`` picks)."""
    key = (id(kv_caches), kv_caches[0][0].data_ptr())  # the runner's one list of caches
    cached = getattr(model, "_c_layer_table", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rows = []
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        ws = [getattr(layer, n) for n in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")]
        lowp = [isinstance(w, PACKED) for w in ws]
        fmts = {getattr(w, "fmt", None) for w in ws}
        if layer.q_norm is not None or (not any(lowp) and not layer.kn) or 0 < sum(lowp) < 4 \
                or len(fmts) > 1:  # one format per layer in C
            model._c_layer_table = (key, None)
            return None
        fmt = 0 if not lowp[0] else _FMT_CODE[ws[0].fmt]
        scale = [w.scale.data_ptr() if fmt >= 2 else 0 for w in ws]
        biases = [getattr(layer, n) for n in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")]
        row: tuple = (fmt, [w.weight.data_ptr() if fmt else w.data_ptr() for w in ws], scale,
                      [0 if b is None else b.data_ptr() for b in biases],
                      layer.input_layernorm.weight.data_ptr(),
                      layer.post_attention_layernorm.weight.data_ptr(),
                      layer.input_layernorm.eps, layer.post_attention_layernorm.eps,
                      k_cache.data_ptr(), v_cache.data_ptr())
        if fmt == _FMT_CODE["int4"]:
            row += ([w._ptrs()[2] for w in ws], [w._ptrs()[3] for w in ws], [w.group_size for w in ws])
        rows.append(row)
    ext = ops.backend(kv_caches[0][0].device)
    assert ext is not None, "forward_fused runs only with the C ops"
    int4 = any(row[0] == _FMT_CODE["int4"] for row in rows)
    q4_rows = ext.INT4_GEMV_MAX_M  # past it the GEMV runs on AVX2 alone, else Python dequantises
    table = ext.DecoderLayers(rows, q4_rows if int4 and ext.linear_route("int4", q4_rows + 1, 0) != "gemv"
                              else sys.maxsize)
    model._c_layer_table = (key, (table, table.max_tokens))
    return table, table.max_tokens
