"""In-process engine with vLLM's offline API: ``pipeline.LLM(model=..., **engine_args)``, then
``generate(prompts, sampling_params)`` / ``chat(messages, ...)`` -> ``list[RequestOutput]``.
docs/python_api.md says what still differs from vLLM.

Runs the same objects as the stage pipeline, in one process and one thread: the tokenizer
and its request validator, the engine's Scheduler, the worker's ModelRunner (or any object
with its interface, e.g. the FakeWorker) and the token processor's OutputProcessor
(detokenization, stop strings); without a tokenizer, ``llm_raw.RawOutputs`` collects token ids and
timings instead. A prompt is a string, a list of token ids, a vLLM prompt dict or a request
dict of pipe mode / ZMQ (``llm_prompts``: one request dict works on every path).

Owns those objects for its lifetime; ``close()`` (or the context manager) releases the
worker's KV cache. Its shared-memory segment records this process as its owner
(``Instance.join`` in the worker's KV cache), and every start sweeps the segments of dead
owners, so an LLM killed by SIGKILL leaves nothing behind past the next start.
State: the stages' objects (the request-id counter is the prompt reader's).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pipeline import llm_chat, llm_compat, llm_tier
from pipeline.config import DEFAULT_MODEL, EngineConfig
from pipeline.engine.core import EngineCore, LocalExecutor
from pipeline.engine.scheduler import Scheduler
from pipeline.engine_args import read_chat_template
from pipeline.llm_prompts import Prompt, PromptReader, is_token_id, per_prompt
from pipeline.llm_raw import RawOutputs
from pipeline.messages import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    RequestResult,
    ids_to_bytes,
)
from pipeline.outputs import EmbeddingRequestOutput, RequestOutput, embedding_output, request_output
from pipeline.progress import ProgressBar
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.validate import InvalidRequest

if TYPE_CHECKING:
    from pipeline.output.processor import OutputProcessor
    from pipeline.tokenizer.tokenizer import Tokenizer

T = TypeVar("T")


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, worker: Any = None,
                 skip_tokenizer_init: bool = False, **engine_args: Any) -> None:
        tokenizer_dir = llm_compat.take(model, engine_args)  # vLLM's arguments without a field here
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
        owned = worker is None
        try:
            if owned:
                from pipeline.ipc.sweep import sweep_stale
                from pipeline.worker.model_runner import ModelRunner

                sweep_stale()  # segments of killed LLMs and servers: their owners are dead
                if self.config.parallel_config.tensor_parallel_size > 1:  # rank 0 here, the others in processes
                    from pipeline.llm_tp import LocalTPWorkers
                    worker = LocalTPWorkers(self.config)
                else:
                    worker = self.worker = ModelRunner(self.config)  # close() releases it if load fails
                    worker.load()
            self.worker = worker
            self._tier: Any = None
            self._tier_group = ""  # EngineStats.kv_tier_group
            hash_key, connector = None, None
            if self.config.cache_config.kv_offload_dir:
                self._tier, self._tier_group, hash_key, connector = llm_tier.start_tier(self.config, worker)
            self.scheduler = Scheduler(self.config, worker.num_blocks, worker.block_size,
                                       worker.max_model_len, hash_key, connector=connector)
            if not skip_tokenizer_init:
                self._init_tokenizer(tokenizer_dir)
            self.prompts = PromptReader(self.tokenizer, worker, worker.max_model_len)
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
    def generate(self, prompts: Any = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool | None | Callable[..., Any] = None,
                 priority: Sequence[int] | None = None, cache_salt: str | None = None,
                 prompt_token_ids: Any = None, lora_request: Any = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        ``prompts``: one prompt or a sequence of them, each a string, a list of token ids, or
        a dict: vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``, or a request
        of pipe mode / ZMQ (``messages``, sampling fields, ``priority``, ``cache_salt``, ``id``;
        its sampling fields override ``sampling_params``). ``use_tqdm``: a progress bar on
        stderr; None shows it when stderr is a terminal; a callable: a tqdm class to draw it.
        ``prompt_token_ids=``: vLLM's older form of token-id prompts."""
        llm_compat.check_lora(lora_request)
        prompts = _prompt_list(llm_compat.prompts_of(prompts, prompt_token_ids))
        self._check_open()
        params = per_prompt(sampling_params, len(prompts))
        prios = [0] * len(prompts) if priority is None else list(priority)
        if len(prios) != len(prompts):
            raise InvalidRequest(f"priority: got {len(prios)} values for {len(prompts)} prompts")
        batch = self._read(prompts, params, prios, cache_salt)
        return self._run_batch(batch, use_tqdm, self._request_output)

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | None | Callable[..., Any] = None, pooling_params: Any = None,
              lora_request: Any = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (prompts as ``generate`` takes them), in their order: the
        prompt's final hidden states pooled as the engine's ``pooling`` says (last token or
        mean), L2-normalised. They run through the same scheduler as generation, prefill only.
        ``truncate_prompt_tokens``: keep the prompt's last k tokens."""
        llm_compat.check_lora(lora_request)
        if pooling_params is not None:
            raise ValueError("pooling_params: not supported; the pooling is the engine's "
                             "(LLM(pooling='last'|'mean')) and vectors are always normalised")
        prompts = _prompt_list(prompts)
        self._check_open()
        sp = SamplingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        batch = self._read(prompts, [sp] * len(prompts), [0] * len(prompts), None, embed=True)
        return self._run_batch(batch, use_tqdm,
                               lambda r, pr: embedding_output(r, pr.request_id, pr.token_ids))

    def _read(self, prompts: list[Any], params: list[SamplingParams], prios: list[int],
              cache_salt: str | None, embed: bool = False) -> list[Prompt]:
        batch = []
        for i, (p, sp, prio) in enumerate(zip(prompts, params, prios)):
            try:
                batch.append(self.prompts.read(p, sp, prio, cache_salt, embed))
            except ValueError as exc:
                raise InvalidRequest(f"prompts[{i}]: {exc}") from None
        return batch

    def _request_output(self, r: RequestResult, pr: Prompt) -> RequestOutput:
        return request_output(r, pr.request_id, pr.text, pr.token_ids, self._decode1)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None | Callable[..., Any] = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
             parallel_tool_calls: bool | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """``generate`` on conversations (one, or a list of them) rendered with the model's
        chat template, or ``chat_template``; ``chat_template_kwargs`` become template
        variables. ``tools`` (OpenAI's) are rendered by the template; ``tool_choice`` as on
        the OpenAI API ("required" or a named function: a grammar forces a valid call; "auto":
        needs ``tool_call_parser`` and ``enable_auto_tool_choice`` on the LLM); the calls and
        the reasoning land in each output's ``tool_calls`` / ``reasoning_content`` / ``content``."""
        llm_compat.check_lora(lora_request)
        convs = cast("list[list[dict]]", [messages] if messages and isinstance(messages[0], dict)
                     else list(messages))
        self._check_open()
        parsing = llm_chat.chat_parsing(self.config.model_config, tools, tool_choice, parallel_tool_calls)
        params = llm_chat.forced(per_prompt(sampling_params, len(convs)), parsing)
        options = dict(chat_template_kwargs or {}, chat_template=chat_template,
                       continue_final_message=continue_final_message)
        if tools:
            options["tools"] = tools
        batch = []
        for i, (conv, sp) in enumerate(zip(convs, params)):
            try:
                text, ids = self.prompts.render(conv, add_generation_prompt, options)
                batch.append(self.prompts.make(text, ids, "messages", sp, 0, None, None))
            except ValueError as exc:
                raise InvalidRequest(f"conversations[{i}]: {exc}" if len(convs) > 1 else str(exc)) from None
        return llm_chat.parse_answers(self._run_batch(batch, use_tqdm, self._request_output), parsing)

    def _check_open(self) -> None:
        if self.worker is None:
            raise RuntimeError("this LLM is closed")

    def stats(self) -> dict[str, int | float | str | list[int]]:
        import msgspec

        return msgspec.structs.replace(self.scheduler.stats(), kv_tier_group=self._tier_group).as_dict()

    def close(self) -> None:
        if getattr(self, "_tier", None) is not None:
            llm_tier.finish_saves(self._tier, getattr(self, "scheduler", None))
            self._tier.close()  # its queued saves written first: a restart finds them
            self._tier = None
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- running ----------------------------------------------------------------------------
    def _run_batch(self, batch: list[Prompt], use_tqdm: bool | None | Callable[..., Any],
                   convert: Callable[[RequestResult, Prompt], T]) -> list[T]:
        results: dict[str, T] = {}
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
                results[r.id] = convert(r, pr)
                progress.update(len(pr.token_ids), r.usage.completion_tokens)

            self._run(emit)
        except BaseException:
            self._abort([rid for rid in queued if rid not in results])
            raise
        finally:
            progress.close()
        return [results[pr.rid] for pr in batch]

    def _add(self, pr: Prompt) -> None:
        assert self.worker is not None  # generate/chat checked it
        now = time.time()
        self.scheduler.add_request(EngineRequest(pr.rid, ids_to_bytes(pr.token_ids), pr.params, now,
                                                 list(self.worker.eos_token_ids), pr.priority,
                                                 pr.cache_salt, embed=pr.embed))
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

        assert self.worker is not None  # generate/chat checked it
        tier = self._tier
        core = EngineCore(self.scheduler, LocalExecutor(self.worker), outputs,
                          send_kv=None if tier is None else tier.submit)
        core.run_until_done(None if tier is None else tier.poll)

    def _abort(self, rids: list[str]) -> None:
        self.scheduler.abort_requests(rids)
        for rid in rids:
            if self.processor is not None:
                self.processor.abort(rid)
            else:
                self._raw.abort(rid)

    def _decode1(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a dict, a list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and is_token_id(prompts[0]):  # one prompt of token ids
        return [prompts]
    return prompts
