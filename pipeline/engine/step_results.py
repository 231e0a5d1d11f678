"""Engine stage: a step's results applied to the requests (the second half of a step).

Owns / State: the counters of what the worker ran (``num_computed_tokens``: prompt,
recomputed and decode tokens), sampled (``num_generated_tokens``) and what came back stale
(``num_stale_results``: results for requests preempted, aborted or finished while in flight:
dropped, so such a request never caches blocks it no longer owns, seed 001). Changes the
Scheduler's requests through it (``sched``): their computed tokens, their newly full blocks
cached, the sampled token appended (``append_token``: the one rule, the decode connector's
first token too), a request ended by it finished.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.engine import inflight
from pipeline.engine.request import Request, RequestStatus
from pipeline.engine.step_outputs import final_output, new_prompt_logprobs, token_output
from pipeline.messages import (
    EngineOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
    bytes_to_ids,
)

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler


def per_request(out: ModelRunnerOutput
                ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs | None]] | None]:
    """Each request's tokens of the step and their logprobs (None: no request asked)."""
    if not out.num_sampled:  # one token each
        tokens = {rid: [t] for rid, t in zip(out.req_ids, out.sampled_token_ids)}
        lps = {rid: [lp] for rid, lp in zip(out.req_ids, out.logprobs)} if out.logprobs else None
        return tokens, lps
    tokens, lps, i = {}, {} if out.logprobs else None, 0
    for rid, k in zip(out.req_ids, out.num_sampled):
        tokens[rid] = out.sampled_token_ids[i:i + k]
        if lps is not None:
            lps[rid] = out.logprobs[i:i + k]
        i += k
    return tokens, lps


class StepResults:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.num_computed_tokens = 0
        self.num_generated_tokens = 0
        self.num_stale_results = 0

    def apply(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineOutput]:
        """Step ``sched``'s results; the outputs to emit."""
        s = self.sched
        sampled, logprobs = per_request(out)
        prompt_lps = {p.req_id: p for p in out.prompt_logprobs} if out.prompt_logprobs else None
        pooled = {p.req_id: p.data for p in out.pooled} if out.pooled else {}
        verified = sched.spec_token_ids  # speculative decoding: the drafts this step verified
        outputs: list[EngineOutput] = []
        any_finished = False
        kv, step, bs = s.kv, sched.step_id, s.block_size
        caching = kv.enable_caching
        requests, conn = s.requests, s.connector
        for rid, n in sched.num_scheduled_tokens.items():
            req = requests.get(rid)
            # Stale: aborted, finished, preempted (maybe re-admitted) since it was scheduled.
            if req is None or not inflight.take_result(req, step, n):
                self.num_stale_results += 1
                continue
            self.num_computed_tokens += n
            toks = sampled.get(rid)
            if verified and (drafts := verified.get(rid)) is not None:
                # The drafts after the first the target disagreed with are not computed KV:
                # their slots are written again by the tokens that replace them.
                num_drafts, accepted = len(drafts) // 4, len(toks) - 1 if toks else 0
                req.num_computed_tokens -= num_drafts - accepted
                assert s.spec is not None  # drafts are scheduled only with it
                s.spec.on_verified(req, num_drafts, accepted)
            computed = req.num_computed_tokens
            if caching and computed // bs > req.num_cached_blocks:
                kv.cache_computed_blocks(req)
            if req.held and computed >= req.num_prompt_tokens:
                s.families.release(req)  # the prompt's blocks are cached now
            plp = new_prompt_logprobs(req, prompt_lps.get(rid)) if prompt_lps else None
            known = req.all_token_ids
            if toks is None:
                if computed == len(known) and req.embed:  # its prefill is its whole work
                    outputs.append(self.embedded(req, pooled.get(rid)))
                    any_finished = True
                    continue
                if computed == len(known):
                    raise RuntimeError(f"worker sampled no token for {rid!r} after computing all "
                                       f"{computed} known tokens")
                if plp:
                    outputs.append(final_output(req, [], None, prompt_logprobs=plp))
                continue
            if computed - len(toks) + 1 != len(known):
                raise RuntimeError(f"worker sampled a token for {rid!r} mid-prefill "
                                   f"({computed}/{len(known)} computed)")
            req.num_placeholders -= 1
            done = False
            for i, tok in enumerate(toks):
                done = self.append_token(req, tok)
                if conn is not None and (ended := conn.on_token(req, tok, done)) is not None:
                    done = ended
                    any_finished = True  # ended or held: out of the running list either way
                if done:
                    toks = toks[:i + 1]  # the rest came after its end: never streamed
                    break
            lps = logprobs.get(rid) if logprobs else None
            if len(toks) > 1:  # accepted drafts filled blocks: cache them before any finish
                if caching and req.num_computed_tokens // bs > req.num_cached_blocks:
                    kv.cache_computed_blocks(req)
                lps = lps[:len(toks)] if lps else None
            outputs.append(token_output(req, toks, done, lps, plp))
            if done:
                any_finished = True
                s.finish(req)
            elif out.draft_token_ids or req.spec_token_ids:  # none proposed: none (stale ones never verify)
                d = out.draft_token_ids.get(rid)
                req.spec_token_ids = bytes_to_ids(d).tolist() if d else []
        if s.spec is not None:  # a token's price only from decode and verify steps (no prefill)
            total = sched.total_num_scheduled_tokens
            n_drafts = sum(len(d) for d in verified.values()) // 4 if verified else 0
            s.spec.observe_step(total, out.execute_s, len(out.sampled_token_ids), out.propose_s, out.num_proposed,
                                total == len(sched.num_scheduled_tokens) + n_drafts, out.num_drafts_asked, n_drafts,
                                len(verified))
        if any_finished:
            s.running = [r for r in s.running if r.status == RequestStatus.RUNNING]
        return outputs

    def embedded(self, req: Request, vector: bytes | None) -> EngineOutput:
        """An embedding request whose prompt is computed: it ends with its pooled vector."""
        if vector is None:  # a worker that does not pool: an error, not a hang
            req.status = RequestStatus.FINISHED_ERROR
            self.sched.finish(req)
            return final_output(req, [], f"the worker pooled no embedding for {req.req_id!r}")
        req.status = RequestStatus.FINISHED_STOPPED
        self.sched.finish(req)
        return final_output(req, [], None, embedding=vector)

    def append_token(self, req: Request, tok: int) -> bool:
        """The one rule for a sampled token: append it, hash a block it filled, and check
        whether it ended the request (status set); True if it did."""
        toks = req.all_token_ids
        toks.append(tok)
        self.num_generated_tokens += 1
        n_toks = len(toks)
        if n_toks % self.sched.block_size == 0 and self.sched.kv.enable_caching:
            self.sched.kv.hash_new_blocks(req)
        max_len = self.sched.max_model_len
        # Inline pre-check: most tokens can end nothing, skip the full stop rules.
        return (tok in req.stop_ids or n_toks >= req.max_num_tokens
                or n_toks >= max_len) and req.check_stop(max_len)
