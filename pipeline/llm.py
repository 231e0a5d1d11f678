"""In-process engine: ``pipeline.LLM(model=..., **engine_args).generate(prompts, params)``.

Runs the same objects as the stage pipeline, in one process and one thread: the tokenizer
and its request validator, the engine's Scheduler, the worker's ModelRunner (or any object
with its interface, e.g. the FakeWorker) and the token processor's OutputProcessor
(detokenization, stop strings). Owns them for its
lifetime; ``close()`` (or the context manager) releases the worker's KV cache.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pipeline.config import DEFAULT_MODEL, EngineConfig
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutputs, EngineRequest, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.validate import check_prompt_text, validate_request

if TYPE_CHECKING:
    from pipeline.output.processor import OutputProcessor
    from pipeline.tokenizer.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    metrics: Any  # pipeline.messages.Timings
    stop_reason: int | str | None = None
    logprobs: list | None = None


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, worker: Any = None,
                 skip_tokenizer_init: bool = False, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineConfig.__struct_fields__)
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}; valid: "
                            f"{sorted(EngineConfig.__struct_fields__)}")
        self.config = EngineConfig(model=model, **engine_args)
        if not self.config.instance_id:
            self.config.instance_id = f"llm{id(self):x}"
        self.worker: Any | None = None  # a ModelRunner, or an object with its interface; None once closed
        self.tokenizer: Tokenizer | None = None
        self.processor: OutputProcessor | None = None
        self._ids = itertools.count()
        owned = worker is None
        try:
            if owned:
                from pipeline.worker.model_runner import ModelRunner
                worker = ModelRunner(self.config)
                self.worker = worker
                worker.load()
            self.worker = worker
            self.scheduler = Scheduler(self.config, worker.num_blocks, worker.block_size,
                                       worker.max_model_len)
            if not skip_tokenizer_init:
                self._init_tokenizer(Path(model))
        except BaseException:
            if owned:  # release the KV cache (shared memory) of a half-built engine
                self.close()
            raise

    def _init_tokenizer(self, model_dir: Path) -> None:
        from pipeline.output.detokenizer import DetokenizerTable
        from pipeline.output.processor import OutputProcessor
        from pipeline.tokenizer.tokenizer import Tokenizer

        try:
            self.tokenizer = Tokenizer(model_dir)
        except FileNotFoundError as exc:
            raise ValueError(f"{exc}; pass skip_tokenizer_init=True and token-id prompts") from None
        self.processor = OutputProcessor(DetokenizerTable(self.tokenizer.tok))

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
        return self.tokenizer.encode(prompt)

    def chat(self, conversations: list[list[dict]] | list[dict],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             **kw: Any) -> list[RequestOutput]:
        """Like ``generate`` on chat messages rendered with the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was set)")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        # Now a list of conversations (or empty): a single one was wrapped above.
        ids = [self.tokenizer.apply_chat_template(c) for c in cast("list[list[dict]]", conversations)]
        return self.generate(ids, sampling_params, **kw)

    def generate(self, prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):  # one prompt of token ids
            prompts = [cast("Sequence[int]", prompts)]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids: list[str] = []
        meta: dict[str, tuple[str | None, list[int], float]] = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = self._add(p, sp, priority[i] if priority else 0, cache_salt, meta)
                ids.append(rid)
            results = self._run(meta)
        except BaseException:
            self._abort(list(meta))
            raise
        return [results[rid] for rid in ids]

    def _add(self, prompt, sp: SamplingParams, priority: int, salt: str | None,
             meta: dict) -> str:
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            check_prompt_text(text)
        tokens = self.encode(prompt) if text is not None else [int(t) for t in prompt]
        if sp.stop and self.processor is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True was set)")
        if self.worker is None:
            raise RuntimeError("this LLM is closed")
        validate_request(tokens, sp, field="prompt" if text is not None else "prompt_token_ids",
                         vocab_size=self.worker.vocab_size,
                         max_model_len=self.scheduler.max_model_len)
        rid = f"llm-{next(self._ids)}"
        now = time.time()
        self.scheduler.add_request(EngineRequest(rid, ids_to_bytes(tokens), sp, now,
                                                 list(self.worker.eos_token_ids), priority, salt))
        if self.processor is not None:
            self.processor.add_request(rid, sp, now, prompt_token_ids=tokens[-8:],
                                       num_prompt_tokens=len(tokens))
        meta[rid] = (text, tokens, now)
        return rid

    def _run(self, meta: dict) -> dict[str, RequestOutput]:
        from pipeline.messages import RequestResult, Timings

        results: dict[str, RequestOutput] = {}
        # Without a token processor (no tokenizer) the timings are kept here.
        raw: dict[str, list[int]] = {rid: [] for rid in meta}
        timings = {rid: Timings(arrival_time=arrival) for rid, (_, _, arrival) in meta.items()}
        last: dict[str, float] = {}

        def emit(r) -> None:
            if isinstance(r, RequestResult):
                text, toks, _ = meta[r.id]
                results[r.id] = RequestOutput(r.id, text, toks, r.text, r.token_ids,
                                              r.finish_reason, r.usage.cached_tokens, r.timings,
                                              r.stop_reason, r.logprobs)

        sched, worker = self.scheduler, self.worker
        while sched.has_unfinished_requests():
            assert worker is not None  # _add, which queued the requests, checked it
            so = sched.schedule()
            outs = sched.update_from_output(so, worker.execute(so))
            if self.processor is None:
                now = time.time()
                for o in outs:
                    raw[o.req_id] += o.new_token_ids
                    t = timings[o.req_id]
                    if o.new_token_ids:
                        if t.first_token_time is None:
                            t.first_token_time, t.ttft = now, now - t.arrival_time
                        else:
                            t.itl.append(now - last[o.req_id])
                        last[o.req_id] = now
                    if o.finish_reason is not None:
                        text, toks, _ = meta[o.req_id]
                        t.first_scheduled_time = o.first_scheduled_time or None
                        if t.first_scheduled_time:
                            t.queue_time = t.first_scheduled_time - t.arrival_time
                        t.finish_time, t.e2e = now, now - t.arrival_time
                        results[o.req_id] = RequestOutput(o.req_id, text, toks, "", raw[o.req_id],
                                                          o.finish_reason, o.num_cached_tokens,
                                                          t, o.stop_reason)
                continue
            stopped = self.processor.process(EngineOutputs(outs, time.time()), emit)
            if stopped:  # a stop string ended them: the engine frees their blocks now
                sched.abort_requests(stopped, reason="stop")
        return results

    def _abort(self, rids: list[str]) -> None:
        self.scheduler.abort_requests(rids)
        if self.processor is not None:
            for rid in rids:
                self.processor.abort(rid)

    def stats(self) -> dict[str, int | float]:
        return self.scheduler.stats().as_dict()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
