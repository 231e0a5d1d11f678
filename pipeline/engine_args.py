"""The engine's flags: argparse builders for the flat flag names (``--max-num-seqs``, ...),
the --chat-template file's checks, and ``config_from_args``, which turns the parsed flags into
a checked ``EngineConfig`` (its typed groups). Owns no state.
"""
from __future__ import annotations

import argparse
import os

from pipeline.config import (
    DEFAULT_KV_OFFLOAD_SIZE,
    DTYPE_ALIASES,
    FIELD_GROUP,
    GROUPS,
    INT4_GROUP_SIZES,
    MAX_BLOCK_SIZE,
    MAX_CHAT_TEMPLATE_BYTES,
    EngineConfig,
)
from pipeline.config_checks import CHOICES, REASONING_PARSERS, TOOL_CALL_PARSERS
from pipeline.sizes import size_arg


class _Defaults:
    """Every flat flag's default, read by the argparse builders."""

    def __getattr__(self, name: str) -> object:
        g = FIELD_GROUP.get(name)
        return getattr(EngineConfig() if g is None else GROUP_DEFAULTS[g], name)


GROUP_DEFAULTS = {g: cls() for g, cls in GROUPS.items()}


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)  # argparse checks the choices after this


def add_engine_args(p: argparse.ArgumentParser) -> None:
    # The model as vLLM takes it: positional (`pipeline serve MODEL`) or --model, one of them;
    # None until resolve_model, so that both given and different can be told apart.
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, as --model (default: the embedded tiny model)")
    p.add_argument("--model", default=None, help="checkpoint directory (Hugging Face format)")
    p.add_argument("--device", default=_Defaults().device, choices=CHOICES["device"])
    p.add_argument("--dtype", default=_Defaults().dtype, type=_dtype, choices=CHOICES["dtype"],
                   metavar="{auto,half,float16,bfloat16,float,float32}",
                   help="half: float16, float: float32 (vLLM's names); on CPU, bfloat16 packs the "
                        "weights as bf16 under float32 activations")
    d = _Defaults()
    p.add_argument("--quantization", default=d.quantization, choices=CHOICES["quantization"],
                   help="int8: quantise float weights per output channel at load (CPU); int4: "
                        "in groups of --quantization-group-size inputs (CPU; GPTQ/AWQ checkpoints "
                        "load as int4 whatever this says, unless int8)")
    p.add_argument("--quantization-group-size", type=int, default=d.quantization_group_size,
                   choices=INT4_GROUP_SIZES, help="int4: inputs per scale")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV block: a power of two up to {MAX_BLOCK_SIZE} (0: 16 on CPU, 64 on GPU)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--kv-cache-memory", type=size_arg, default=d.kv_cache_memory,
                   help="bytes of KV cache (CPU). Default: as much as the weights take, at least 64 MiB "
                        "and one max_model_len sequence, at most what max_num_seqs sequences of "
                        "max_model_len fill and half the free memory; pages are allocated as used")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--kv-offload-dir", default=d.kv_offload_dir,
                   help="a second KV tier: prefix blocks kept in files under this directory, across "
                        "restarts and shared by the instances of this host (docs/kv_tier.md)")
    p.add_argument("--kv-offload-size", type=size_arg, default=d.kv_offload_size,
                   help=f"bytes the --kv-offload-dir tier keeps, e.g. 20GiB (0: "
                        f"{DEFAULT_KV_OFFLOAD_SIZE >> 30} GiB)")
    p.add_argument("--kv-offload-host", type=size_arg, default=d.kv_offload_host,
                   help="a KV tier in pinned host memory: for a KV cache on CUDA (not built yet)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--preemption-policy", default=d.preemption_policy, choices=CHOICES["preemption_policy"])
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="worker ranks that split every layer (torch.distributed), on this host or "
                        "across --nnodes hosts")
    p.add_argument("--distributed-backend", default=d.distributed_backend,
                   choices=CHOICES["distributed_backend"], help="auto: nccl on CUDA, gloo on CPU")
    p.add_argument("--worker-threads", type=int, default=d.worker_threads,
                   help="CPU threads of the worker, fixed (0: PIPELINE_WORKER_THREADS if set, else a team "
                        "that starts with every core and shrinks while cores are busy)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--step-log", metavar="FILE", default=d.step_log,
                   help="append one JSON line per engine step to FILE: tokens, queues, and where the "
                        "time went (schedule, worker, the worker's wait for the step, update)")
    p.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="CUDA: no captured decode graphs, every step eager (CPU steps always are)")
    p.add_argument("--pooling", default=d.pooling, choices=CHOICES["pooling"],
                   help="embeddings: the prompt's final hidden states pooled as the last token's or "
                        "their mean, L2-normalised (mean turns the prefix cache off for embeddings)")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='speculative decoding, vLLM\'s keys: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 5} or {"method": '
                        '"suffix", "num_speculative_tokens": 8} (docs/speculative.md)')
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template file that replaces the checkpoint's (at most "
                        f"{MAX_CHAT_TEMPLATE_BYTES >> 20} MiB)")
    g = p.add_argument_group("chat answers: tool calls and reasoning (docs/openai.md)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=d.enable_auto_tool_choice,
                   help='tool_choice "auto": parse the calls the model makes (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=TOOL_CALL_PARSERS,
                   help="the format the model calls tools in (hermes: Qwen2.5/Qwen3)")
    g.add_argument("--reasoning-parser", default=d.reasoning_parser, choices=REASONING_PARSERS,
                   help="<think>...</think> goes to reasoning_content (qwen3, deepseek_r1)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests, metavar="N",
                   help="refuse a request (error queue_full) when max-num-seqs + N are already in "
                        "flight (0: no limit)")


def add_pd_args(p: argparse.ArgumentParser) -> None:
    """`pipeline serve` only: the instance's side in prefill/decode disaggregation."""
    d = _Defaults()
    g = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    g.add_argument("--role", default=d.role, choices=CHOICES["role"],
                   help="mixed: prefill and decode here (default); prefill or decode: one side of "
                        "a disaggregated pair, behind `pipeline router --prefill/--decode`")
    g.add_argument("--kv-transfer", default=d.kv_transfer, choices=CHOICES["kv_transfer"],
                   help="how a prefill instance ships KV: ipc (same host, straight into the decode "
                        "instance's shared KV pool), tcp, or auto (ipc when possible)")
    g.add_argument("--kv-listen", default=d.kv_listen, metavar="tcp://HOST:PORT",
                   help="decode: where its cache messager receives KV (default: an ipc:// socket, "
                        "same host only)")
    g.add_argument("--kv-transfer-timeout", type=float, default=d.kv_transfer_timeout, metavar="S",
                   help="decode: free a reservation (failing its request) that got no KV within S s")
    g.add_argument("--pd-fallback", default=d.pd_fallback, choices=CHOICES["pd_fallback"],
                   help="prefill: a request whose KV cannot reach its decode peer fails (none, "
                        "default) or is decoded here instead (local)")


def add_node_args(p: argparse.ArgumentParser) -> None:
    """`pipeline serve` only: tensor parallelism across hosts (torchrun's flag names)."""
    d = _Defaults()
    g = p.add_argument_group("tensor parallelism across hosts (docs/tensor_parallel.md)")
    g.add_argument("--nnodes", type=int, default=d.nnodes,
                   help="hosts the --tensor-parallel-size ranks are spread over (as many on each)")
    g.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="0: the host that serves (gateway, every stage, its ranks); R > 0: a host "
                        "that runs only its worker ranks")
    g.add_argument("--master-addr", default=d.master_addr, help="node 0's address, as the others reach it")
    g.add_argument("--master-port", type=int, default=d.master_port,
                   help="node 0's rendezvous port (torch.distributed; the step plans use the next one)")


def read_chat_template(path: str | os.PathLike[str]) -> str:
    """The text of a --chat-template file: readable UTF-8, at most MAX_CHAT_TEMPLATE_BYTES, and
    a template Jinja can parse (so a broken file fails at start-up, not on the first chat)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CHAT_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--chat-template {path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_CHAT_TEMPLATE_BYTES:
        raise ValueError(f"--chat-template {path}: larger than the limit of "
                         f"{MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--chat-template {path}: not UTF-8 (byte offset {exc.start})") from None
    import jinja2
    try:  # the extensions the tokenizer's environment has (tokenizer.py _compile)
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {path}: not a valid Jinja template: line {exc.lineno}: "
                         f"{exc.message}") from None
    return text


def resolve_model(a: argparse.Namespace) -> None:
    """``a.model`` from the positional MODEL or --model (the default model if neither);
    ValueError naming both when both are given and differ."""
    tag, flag = getattr(a, "model_tag", None), getattr(a, "model", None)
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"the model is given twice and differs: positional {tag!r} and "
                         f"--model {flag!r}; give one")
    a.model = tag if tag is not None else flag if flag is not None else _Defaults().model


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags; ValueError naming a flag whose value is out of range
    or a --chat-template file that cannot be used (its text is what the config holds)."""
    resolve_model(a)
    fields = {f: getattr(a, f) for f in EngineConfig.field_names() if hasattr(a, f)}
    if fields.get("chat_template") is not None:
        fields["chat_template"] = read_chat_template(fields["chat_template"])
    cfg = EngineConfig.of(**fields)
    cfg.check()
    if not cfg.instance_id:
        cfg.instance_id = f"{os.getpid():x}"
    return cfg
