"""In-process engine with vLLM's offline API: ``pipeline.LLM(model=..., **engine_args)``, then
``generate(prompts, sampling_params)`` / ``chat(messages, ...)`` -> ``list[RequestOutput]``.
docs/python_api.md says what still differs from vLLM.

Runs the same objects as the stage pipeline, in one process and one thread: the tokenizer
and its request validator, the engine's Scheduler, the worker's ModelRunner (or any object
with its interface, e.g. the FakeWorker) and the token processor's OutputProcessor
(detokenization, stop strings); without a tokenizer, ``llm_raw.RawOutputs`` collects token ids and
timings instead. A prompt is a string, a list of token ids, a vLLM prompt dict or a request
dict of pipe mode / ZMQ (read by the same parser, so one request dict works on every path).

Owns those objects for its lifetime; ``close()`` (or the context manager) releases the
worker's KV cache. Its shared-memory segment records this process as its owner
(``Instance.join`` in the worker's KV cache), and every start sweeps the segments of dead
owners, so an LLM killed by SIGKILL leaves nothing behind past the next start.
State: the stages' objects and the request-id counter.
"""
from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from pipeline.config import DEFAULT_MODEL, EngineConfig
from pipeline.engine.core import EngineCore, LocalExecutor
from pipeline.engine.scheduler import Scheduler
from pipeline.engine_args import read_chat_template
from pipeline.llm_raw import RawOutputs
from pipeline.messages import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    RequestResult,
    TokenLogprobs,
    ids_to_bytes,
)
from pipeline.messages.answers import Completion
from pipeline.outputs import CompletionOutput, Logprob, RequestOutput
from pipeline.progress import ProgressBar
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.validate import InvalidRequest, check_prompt_text, one_prompt_field, prepare_request

if TYPE_CHECKING:
    from pipeline.output.processor import OutputProcessor
    from pipeline.tokenizer.tokenizer import Tokenizer

MULTI_MODAL_FIELDS = ("multi_modal_data", "mm_processor_kwargs")


@dataclass(slots=True)
class _Prompt:
    """A validated prompt of one generate/chat call, before it is queued."""
    request_id: str  # the caller's (a request dict's "id") or ours; the engine uses `rid`
    rid: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, worker: Any = None,
                 skip_tokenizer_init: bool = False, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}; valid: "
                            f"{sorted(EngineConfig.field_names())}")
        from pipeline.ipc.instance import new_instance_id

        if engine_args.get("chat_template") is not None:  # a file, as --chat-template takes
            engine_args["chat_template"] = read_chat_template(engine_args["chat_template"])
        self.config = EngineConfig.of(model=model, **engine_args)
        self.config.check()  # a bad value is named before anything loads
        # "<pid>-<hex>": unique across processes (the KV segment is named after it).
        self.config.instance_id = self.config.instance_id or new_instance_id()
        self.worker: Any | None = None  # a ModelRunner, or an object with its interface; None once closed
        self.tokenizer: Tokenizer | None = None
        self.processor: OutputProcessor | None = None
        self._raw = RawOutputs()  # used instead of the processor without a tokenizer
        self._ids = itertools.count()
        owned = worker is None
        try:
            if owned:
                from pipeline.ipc.sweep import sweep_stale
                from pipeline.worker.model_runner import ModelRunner

                sweep_stale()  # segments of killed LLMs and servers: their owners are dead
                if self.config.parallel_config.tensor_parallel_size > 1:  # rank 0 here, the others in processes
                    from pipeline.llm_tp import LocalTPWorkers
                    worker = LocalTPWorkers(self.config)
                    self.worker = worker
                else:
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
            self.tokenizer = Tokenizer(model_dir, chat_template=self.config.model_config.chat_template)
        except FileNotFoundError as exc:
            raise ValueError(f"{exc}; pass skip_tokenizer_init=True and token-id prompts") from None
        self.processor = OutputProcessor(DetokenizerTable(self.tokenizer.tok))

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("no tokenizer: skip_tokenizer_init=True was set")
        return self.tokenizer

    # ---- the API ----------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool | None = None, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        ``prompts``: one prompt or a sequence of them, each a string, a list of token ids, or
        a dict: vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``, or a request
        of pipe mode / ZMQ (``messages``, sampling fields, ``priority``, ``cache_salt``, ``id``;
        its sampling fields override ``sampling_params``). ``use_tqdm``: a progress bar on
        stderr; None shows it when stderr is a terminal."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        else:
            prompts = list(prompts)
            if prompts and _is_token_id(prompts[0]):  # one prompt of token ids
                prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        prios = [0] * len(prompts) if priority is None else list(priority)
        if len(prios) != len(prompts):
            raise InvalidRequest(f"priority: got {len(prios)} values for {len(prompts)} prompts")
        batch = []
        for i, (p, sp, prio) in enumerate(zip(prompts, params, prios)):
            try:
                batch.append(self._prompt(p, sp, prio, cache_salt))
            except ValueError as exc:
                raise InvalidRequest(f"prompts[{i}]: {exc}") from None
        return self._run_batch(batch, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """``generate`` on conversations (one, or a list of them) rendered with the model's
        chat template, or ``chat_template``; ``chat_template_kwargs`` become template
        variables (e.g. ``tools``)."""
        convs = cast("list[list[dict]]", [messages] if messages and isinstance(messages[0], dict)
                     else list(messages))
        params = _per_prompt(sampling_params, len(convs))
        options = dict(chat_template_kwargs or {}, chat_template=chat_template,
                       continue_final_message=continue_final_message)
        batch = []
        for i, (conv, sp) in enumerate(zip(convs, params)):
            try:
                text, ids = self._render(conv, add_generation_prompt, options)
                batch.append(self._make(text, ids, "messages", sp, 0, None, None))
            except ValueError as exc:
                raise InvalidRequest(f"conversations[{i}]: {exc}" if len(convs) > 1 else str(exc)) from None
        return self._run_batch(batch, use_tqdm)

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

    # ---- prompts ----------------------------------------------------------------------------
    def _prompt(self, p: Any, sp: SamplingParams, priority: int, salt: str | None) -> _Prompt:
        if isinstance(p, str):
            check_prompt_text(p)
            return self._make(p, self._encode(p), "prompt", sp, priority, salt, None)
        if isinstance(p, dict):
            return self._from_dict(p, sp, priority, salt)
        if isinstance(p, Sequence):
            ids = []
            for j, t in enumerate(p):
                if not _is_token_id(t):
                    raise InvalidRequest(f"field `prompt_token_ids[{j}]`: token ids must be integers, "
                                         f"got {type(t).__name__}")
                ids.append(int(t))
            return self._make(None, ids, "prompt_token_ids", sp, priority, salt, None)
        raise InvalidRequest(f"a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")

    def _from_dict(self, p: dict, sp: SamplingParams, priority: int, salt: str | None) -> _Prompt:
        """vLLM's prompt dicts and pipe mode's / ZMQ's request dicts, by the protocol's parser."""
        from pipeline.frontend.request_parser import request_from_json

        for key in MULTI_MODAL_FIELDS:
            if key in p:
                raise InvalidRequest(f"field `{key}`: multi-modal input is not supported "
                                     "(text-only models)")
        gen, sp = request_from_json(p, msgspec.structs.asdict(sp))
        field = one_prompt_field(prompt=gen.prompt, prompt_token_ids=gen.prompt_token_ids,
                                 messages=gen.messages)
        priority = gen.priority if "priority" in p else priority
        salt = salt if gen.cache_salt is None else gen.cache_salt
        rid = None if gen.id is None else str(gen.id)
        from pipeline.tokenizer.tokenizer import check_chat_options

        options = check_chat_options(has_messages=gen.messages is not None,
                                     add_generation_prompt=gen.add_generation_prompt,
                                     continue_final_message=gen.continue_final_message,
                                     chat_template_kwargs=gen.chat_template_kwargs)
        if gen.messages is not None:
            text, ids = self._render(msgspec.to_builtins(gen.messages), gen.add_generation_prompt,
                                     options)
        elif gen.prompt is not None:
            check_prompt_text(gen.prompt)
            text, ids = gen.prompt, self._encode(gen.prompt)
        else:
            text, ids = None, list(gen.prompt_token_ids or [])
        return self._make(text, ids, field, sp, priority, salt, rid)

    def _render(self, conv: list[dict], add_generation_prompt: bool,
                options: dict[str, Any]) -> tuple[str, list[int]]:
        tok = self.get_tokenizer()
        text = tok.render_chat(conv, add_generation_prompt, **options)
        return text, tok.encode(text, add_special_tokens=False)  # the template places BOS

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
        return self.tokenizer.encode(text)

    def _make(self, text: str | None, ids: list[int], field: str, sp: SamplingParams,
              priority: int, salt: str | None, request_id: str | None) -> _Prompt:
        if self.worker is None:
            raise RuntimeError("this LLM is closed")
        tok = self.tokenizer
        if tok is None and (sp.stop or sp.bad_words):
            raise InvalidRequest("stop strings and bad_words need a tokenizer "
                                 "(skip_tokenizer_init=True was set)")
        ids, sp = prepare_request(
            ids, sp, field=field, vocab_size=self.worker.vocab_size,
            max_model_len=self.scheduler.max_model_len,
            encode=None if tok is None else lambda w: tok.encode(w, add_special_tokens=False))
        structured = getattr(self.worker, "structured", None)
        if sp.structured_outputs is not None:  # refused here, as the tokenizer stage refuses it
            if structured is None:
                raise InvalidRequest("structured_outputs: this worker has no grammar support")
            structured.validate(sp.structured_outputs)  # compiles into the worker's cache
        rid = f"llm-{next(self._ids)}"
        return _Prompt(request_id or rid, rid, text, ids, sp, priority, salt)

    # ---- running ----------------------------------------------------------------------------
    def _run_batch(self, batch: list[_Prompt], use_tqdm: bool | None) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        queued: list[str] = []
        progress = ProgressBar(len(batch), use_tqdm)
        try:
            by_rid = {}
            for pr in batch:
                self._add(pr)
                queued.append(pr.rid)
                by_rid[pr.rid] = pr

            def emit(r: RequestResult) -> None:
                pr = by_rid[r.id]
                results[r.id] = self._output(r, pr)
                progress.update(len(pr.token_ids), r.usage.completion_tokens)

            self._run(emit)
        except BaseException:
            self._abort([rid for rid in queued if rid not in results])
            raise
        finally:
            progress.close()
        return [results[pr.rid] for pr in batch]

    def _add(self, pr: _Prompt) -> None:
        assert self.worker is not None  # _make checked it
        now = time.time()
        self.scheduler.add_request(EngineRequest(pr.rid, ids_to_bytes(pr.token_ids), pr.params, now,
                                                 list(self.worker.eos_token_ids), pr.priority,
                                                 pr.cache_salt))
        if self.processor is not None:
            self.processor.add_request(pr.rid, pr.params, now, prompt_token_ids=pr.token_ids[-8:],
                                       num_prompt_tokens=len(pr.token_ids))
        else:
            self._raw.add(pr.rid, pr.params, now, len(pr.token_ids))

    def _run(self, emit: Callable[[RequestResult], None]) -> None:
        def answer(r: Any) -> None:  # the processor's deltas are for streams: none here
            if isinstance(r, RequestResult):
                emit(r)

        def outputs(outs: list[EngineOutput]) -> None:
            if self.processor is None:
                self._raw.process(outs, time.time(), emit)
                return
            stopped = self.processor.process(EngineOutputs(outs, time.time()), answer)
            if stopped:  # a stop string ended them: the engine frees their blocks now (their
                self.scheduler.abort_requests(stopped, reason="stop")  # answers are out already)

        assert self.worker is not None  # _make, which built the requests, checked it
        core = EngineCore(self.scheduler, LocalExecutor(self.worker), outputs)
        core.run_until_done()

    def _abort(self, rids: list[str]) -> None:
        self.scheduler.abort_requests(rids)
        for rid in rids:
            if self.processor is not None:
                self.processor.abort(rid)
            else:
                self._raw.abort(rid)

    # ---- answers ----------------------------------------------------------------------------
    def _output(self, r: RequestResult, pr: _Prompt) -> RequestOutput:
        completions = r.outputs or [Completion(
            index=0, text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, logprobs=r.logprobs, cumulative_logprob=r.cumulative_logprob)]
        outputs = [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob,
                                    None if c.logprobs is None else [self._position(x) for x in c.logprobs],
                                    c.finish_reason, c.stop_reason) for c in completions]
        prompt_logprobs = None if r.prompt_logprobs is None else \
            [None if x is None else self._position(x) for x in r.prompt_logprobs]
        return RequestOutput(pr.request_id, pr.text, pr.token_ids, prompt_logprobs, outputs,
                             True, r.timings, r.usage.cached_tokens, r.error)

    def _position(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """One position's logprobs as vLLM shows them: the sampled token first, then the top-N
        by rank (a token in both appears once, with its rank)."""
        ranks = {t: i for i, t in enumerate(lp.top_ids, 1)}
        out = {lp.token_id: Logprob(lp.logprob, ranks.get(lp.token_id), self._decode1(lp.token_id))}
        for t, x in zip(lp.top_ids, lp.top_logprobs):
            if t not in out:
                out[t] = Logprob(x, ranks[t], self._decode1(t))
        return out

    def _decode1(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)


def _is_token_id(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    values = list(sampling_params)
    if len(values) != n:
        raise InvalidRequest(f"sampling_params: got {len(values)} for {n} prompts")
    return values
