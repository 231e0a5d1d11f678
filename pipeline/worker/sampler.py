"""Worker stage: turn the last-position logits of a step into sampled tokens and logprobs.

Owns the random generators only. Everything is vectorised across the batch: penalties,
min-tokens EOS masking, temperature, top-k / top-p (one shared sort), min-p, and sampling by
the exponential race (argmax of probs / Exp(1) noise), which lets a seeded request draw its
noise from its own generator, seeded from (seed, output position), so the same seed gives the
same tokens whatever else shares the batch. All-greedy batches skip straight to argmax.
The per-request logits processors run on the rows that have them, after the penalties and
before greedy or random choice: logit_bias adds, allowed_token_ids masks every other token,
bad words ban a sequence's last token when the output ends with the rest of it.
Logprobs are of the raw model distribution (before penalties and temperature), as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.layers.ops_fused import argmax
from pipeline.messages import TokenLogprobs
from pipeline.worker.input_batch import InputBatch

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): decorrelated per-step seeds for one request."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SamplingMetadata:
    all_greedy: bool
    greedy: torch.Tensor | None  # [N] bool
    temperature: torch.Tensor | None  # [N, 1], 1.0 on greedy rows
    top_k: torch.Tensor | None  # [N, 1] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [N, 1]
    min_p: torch.Tensor | None  # [N, 1]
    repetition_penalty: torch.Tensor | None  # [N, 1]
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    prompt_tokens: torch.Tensor | None  # [N, Lp] int64, padded with vocab_size
    output_tokens: torch.Tensor | None  # [N, Lo] int64, padded with vocab_size
    seeded: list[tuple[int, int]]  # (batch index, mixed seed) of seeded sampling rows
    banned: list[tuple[int, list[int]]]  # (batch index, token ids) masked: min_tokens, bad words
    bias: list[tuple[int, torch.Tensor, torch.Tensor]]  # (batch index, token ids, added logits)
    allowed: list[tuple[int, torch.Tensor]]  # (batch index, the only token ids it may take)
    num_logprobs: np.ndarray  # [N], -1 where not requested
    max_num_logprobs: int


def _col(a: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype).unsqueeze(1)


def build_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                   eos_token_ids: list[int], device: torch.device) -> SamplingMetadata:
    """Sampling settings of ``rows`` (batch order), at the moment their next token is drawn."""
    temp = batch.temperature[rows]
    greedy_np = temp == 0.0
    all_greedy = bool(greedy_np.all())
    num_out = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    banned: list[tuple[int, list[int]]] = []
    for i in np.nonzero(num_out < batch.min_tokens[rows])[0].tolist():
        sp = batch.params[int(rows[i])]
        assert sp is not None  # a live row
        banned.append((i, [t for t in {*eos_token_ids, *sp.stop_token_ids} if 0 <= t < vocab_size]))
    bias: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    allowed: list[tuple[int, torch.Tensor]] = []
    for i in np.nonzero(batch.has_processors[rows])[0].tolist():
        row = int(rows[i])
        if (b := batch.logit_bias[row]) is not None:
            bias.append((i, torch.from_numpy(b[0]).to(device), torch.from_numpy(b[1]).to(device)))
        if (a := batch.allowed_token_ids[row]) is not None:
            allowed.append((i, torch.from_numpy(a).to(device)))
        if (words := batch.bad_words[row]) is not None:
            ban = _bad_word_ends(words, batch.token_ids[row, :batch.num_tokens[row]], int(num_out[i]))
            if ban:
                banned.append((i, ban))
    rep, pres, freq = (batch.repetition_penalty[rows], batch.presence_penalty[rows],
                       batch.frequency_penalty[rows])
    any_rep = bool((rep != 1.0).any())
    any_out_pen = bool((pres != 0.0).any() or (freq != 0.0).any())
    prompt_tokens = output_tokens = None
    if any_rep or any_out_pen:
        n_prompt, n_tok = batch.num_prompt_tokens[rows], batch.num_tokens[rows]
        width = int(n_tok.max())
        tok = batch.token_ids[rows, :width].astype(np.int64)
        col = np.arange(width)[None, :]
        prompt_tokens = torch.from_numpy(np.where(col < n_prompt[:, None], tok, vocab_size)).to(device)
        output_tokens = torch.from_numpy(np.where((col >= n_prompt[:, None]) & (col < n_tok[:, None]),
                                                  tok, vocab_size)).to(device)
    seeded: list[tuple[int, int]] = []
    sampling = ~greedy_np
    top_k = top_p = min_p = temperature = greedy = None
    if not all_greedy:
        seeds = batch.seed[rows]
        for i in np.nonzero(sampling & (seeds >= 0))[0].tolist():
            seeded.append((i, mix_seed(int(seeds[i]), int(num_out[i]))))
        temperature = _col(np.where(greedy_np, 1.0, temp), device, torch.float32)
        greedy = torch.from_numpy(greedy_np).to(device)
        k = batch.top_k[rows]
        if ((k > 0) & (k < vocab_size) & sampling).any():
            top_k = _col(np.where((k > 0) & sampling, k, vocab_size), device, torch.int64)
        p = batch.top_p[rows]
        if ((p < 1.0) & sampling).any():
            top_p = _col(np.where(sampling, p, 1.0), device, torch.float32)
        mp = batch.min_p[rows]
        if ((mp > 0.0) & sampling).any():
            min_p = _col(np.where(sampling, mp, 0.0), device, torch.float32)
    nlp = batch.num_logprobs[rows]
    return SamplingMetadata(
        all_greedy=all_greedy, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p,
        repetition_penalty=_col(rep, device, torch.float32) if any_rep else None,
        presence_penalty=_col(pres, device, torch.float32) if any_out_pen else None,
        frequency_penalty=_col(freq, device, torch.float32) if any_out_pen else None,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, seeded=seeded, banned=banned,
        bias=bias, allowed=allowed, num_logprobs=nlp, max_num_logprobs=int(nlp.max()) if len(nlp) else -1)


def _bad_word_ends(words: list[list[int]], tokens: np.ndarray, num_out: int) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output (not the prompt, as in
    vLLM): taking one would complete the word."""
    ban = []
    for w in words:
        head = len(w) - 1
        if head == 0 or (head <= num_out and tokens[len(tokens) - head:].tolist() == w[:-1]):
            ban.append(w[-1])
    return ban


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.row_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[torch.Tensor, list[TokenLogprobs | None] | None]:
        """logits [N, V] float32 (modified in place) -> (tokens [N] int64, logprobs or None)."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs >= 0 else None
        self._penalize(logits, md)
        for i, ids, values in md.bias:
            logits[i, ids] += values
        for i, ids in md.allowed:
            keep = logits[i, ids]
            logits[i] = float("-inf")
            logits[i, ids] = keep
        for i, ids in md.banned:
            logits[i, ids] = float("-inf")
        if md.all_greedy:
            tokens = argmax(logits)
        else:
            tokens = self._sample(logits, md)
        return tokens, (self._logprobs(raw_logprobs, tokens, md) if raw_logprobs is not None else None)

    @staticmethod
    def _penalize(logits: torch.Tensor, md: SamplingMetadata) -> None:
        n, v = logits.shape
        if md.output_tokens is None:
            return
        counts = torch.zeros((n, v + 1), dtype=torch.float32, device=logits.device)
        counts.scatter_add_(1, md.output_tokens, torch.ones_like(md.output_tokens, dtype=torch.float32))
        counts = counts[:, :v]
        if md.repetition_penalty is not None:
            seen = torch.zeros((n, v + 1), dtype=torch.bool, device=logits.device)
            seen.scatter_(1, md.prompt_tokens, True)
            seen = seen[:, :v] | (counts > 0)
            p = md.repetition_penalty.expand_as(logits)
            penalized = torch.where(logits > 0, logits / p, logits * p)
            torch.where(seen, penalized, logits, out=logits)
        if md.frequency_penalty is not None:
            logits -= md.frequency_penalty * counts
            logits -= md.presence_penalty * (counts > 0).float()

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = argmax(logits)
        logits = logits / md.temperature
        if md.top_k is not None or md.top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if md.top_k is not None:
                ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
                sorted_logits.masked_fill_(ranks >= md.top_k, float("-inf"))
            if md.top_p is not None:
                probs = sorted_logits.softmax(dim=-1)
                # Keep a token while the mass strictly before it is below top_p (>= 1 token).
                before = probs.cumsum(dim=-1) - probs
                sorted_logits.masked_fill_(before > md.top_p, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            floor = md.min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seed in md.seeded:
            self.row_generator.manual_seed(seed)
            noise[i].exponential_(generator=self.row_generator)
        noise.clamp_(min=1e-30)  # a zero draw would turn a zero-probability token into nan
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(md.greedy, greedy_tokens, sampled)

    @staticmethod
    def _logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, md: SamplingMetadata
                  ) -> list[TokenLogprobs | None]:
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if md.max_num_logprobs > 0:
            vals, ids = logprobs.topk(md.max_num_logprobs, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        toks = tokens.tolist()
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(md.num_logprobs.tolist()):
            if n < 0:
                out.append(None)
            elif n == 0:
                out.append(TokenLogprobs(toks[i], chosen[i], [], []))
            else:
                out.append(TokenLogprobs(toks[i], chosen[i], top_ids[i][:n], top_vals[i][:n]))
        return out
