"""Engine stage (tests and `pipeline bench scheduler`): a deterministic worker without a model.

Implements the worker contract of ``ModelRunner.execute`` exactly: it keeps its own copy of
each request (tokens, blocks, computed count) built from the step diffs, drops finished and
preempted ids first, and samples one token for a request only when ``num_computed_tokens +
scheduled == all known tokens``, appending it to its copy as the real worker does (so a step
scheduled ahead of its result, async scheduling, decodes it). The sampled token is a pure
function of the request's whole token sequence, so outputs do not depend on batching,
chunking, caching or preemption.
Prompt logprobs, for requests that ask, are a pure function of the position (``logprob =
-position``), so a test can tell each prompt token's entry apart.

With ``check_kv=True`` it also simulates the paged KV cache: every computed position writes a
fingerprint of the sequence prefix it belongs to into its slot, and before sampling every slot
of the sequence is verified. A wrong prefix-cache hit, a block reused while still owned, or a
wrong block table therefore fails loudly instead of silently producing tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs, bytes_to_ids
from pipeline.messages.step import PromptLogprobs

_MASK = (1 << 64) - 1


def _mix(h: int, tok: int) -> int:
    h = ((h ^ (tok + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK
    return (h ^ (h >> 31)) & _MASK


@dataclass(slots=True)
class _Seq:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    num_prompt: int = 0
    prompt_logprobs: bool = False
    fps: list[int] = field(default_factory=list)  # fps[p]: fingerprint of tokens[:p + 1]
    h: int = 0  # fingerprint of tokens[:h_len], advanced lazily
    h_len: int = 0


class FakeWorker:
    def __init__(self, num_blocks: int = 1024, block_size: int = 16, max_model_len: int = 4096,
                 vocab_size: int = 32000, eos_token_ids: list[int] | None = None,
                 check_kv: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids or [])
        self.check_kv = check_kv
        self.seqs: dict[str, _Seq] = {}
        self.kv: list[int] | None = [-1] * (num_blocks * block_size) if check_kv else None
        self.num_steps = 0

    def load(self) -> FakeWorker:
        return self

    def close(self) -> None:
        self.seqs.clear()

    def next_token(self, tokens: list[int]) -> int:
        """The token this worker samples after ``tokens`` (what every run must produce)."""
        h = 0
        for t in tokens:
            h = _mix(h, t)
        return (h >> 17) % self.vocab_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for rid in sched.finished_req_ids:
            self.seqs.pop(rid, None)
        for rid in sched.preempted_req_ids:
            self.seqs.pop(rid, None)
        for nr in sched.new_reqs:
            self.seqs[nr.req_id] = _Seq(bytes_to_ids(nr.token_ids).tolist(), list(nr.block_ids),
                                        nr.num_computed_tokens, nr.num_prompt_tokens,
                                        nr.sampling_params.prompt_logprobs is not None)
        for cr in sched.cached_reqs:
            s = self.seqs[cr.req_id]
            if s.num_computed != cr.num_computed_tokens:
                raise AssertionError(f"{cr.req_id}: engine says {cr.num_computed_tokens} computed, "
                                     f"worker has {s.num_computed}")
            s.block_ids.extend(cr.new_block_ids)
        req_ids: list[str] = []
        sampled: list[int] = []
        prompt_lps: list[PromptLogprobs] = []
        bs = self.block_size
        for rid, n in sched.num_scheduled_tokens.items():
            s = self.seqs[rid]
            end = s.num_computed + n
            if n < 1 or end > len(s.tokens):
                raise AssertionError(f"{rid}: {n} tokens scheduled after {s.num_computed} "
                                     f"computed of {len(s.tokens)} known")
            if end > len(s.block_ids) * bs:
                raise AssertionError(f"{rid}: {end} tokens but only {len(s.block_ids)} blocks")
            if self.kv is not None:
                self._write_kv(s, end)
            last = min(end, s.num_prompt - 1)  # position p predicts prompt token p + 1
            if s.prompt_logprobs and last > s.num_computed:
                prompt_lps.append(PromptLogprobs(rid, s.num_computed + 1, [
                    TokenLogprobs(s.tokens[p + 1], -float(p + 1), [], [])
                    for p in range(s.num_computed, last)]))
            s.num_computed = end
            if end == len(s.tokens):
                if self.kv is not None:
                    self._verify_kv(rid, s)
                for t in s.tokens[s.h_len:]:
                    s.h = _mix(s.h, t)
                s.h_len = len(s.tokens)
                tok = (s.h >> 17) % self.vocab_size
                s.tokens.append(tok)
                req_ids.append(rid)
                sampled.append(tok)
        return ModelRunnerOutput(sched.step_id, req_ids, sampled, prompt_logprobs=prompt_lps)

    def _fingerprints(self, s: _Seq, upto: int) -> None:
        h = s.fps[-1] if s.fps else 0
        for t in s.tokens[len(s.fps):upto]:
            h = _mix(h, t)
            s.fps.append(h)

    def _write_kv(self, s: _Seq, end: int) -> None:
        self._fingerprints(s, end)
        bs, kv = self.block_size, self.kv
        for p in range(s.num_computed, end):
            kv[s.block_ids[p // bs] * bs + p % bs] = s.fps[p]  # type: ignore[index]

    def _verify_kv(self, rid: str, s: _Seq) -> None:
        self._fingerprints(s, s.num_computed)
        bs, kv = self.block_size, self.kv
        for p in range(s.num_computed):
            if kv[s.block_ids[p // bs] * bs + p % bs] != s.fps[p]:  # type: ignore[index]
                raise AssertionError(f"{rid}: KV at position {p} (block {s.block_ids[p // bs]}) "
                                     f"belongs to another sequence")
