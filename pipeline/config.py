"""Shared by every stage: the engine configuration, built once by the entry point.

The gateway parses flags into an EngineConfig, checks it (``EngineConfig.check``, before
anything loads) and hands it (msgspec-encoded) to each stage. Its fields are typed groups with
vLLM's names: ``model_config``, ``cache_config``, ``scheduler_config``, ``parallel_config``,
``kv_transfer_config``, each checking its own fields; the flags stay flat (``--max-num-seqs``,
``LLM(max_num_seqs=...)``) and ``EngineConfig.of`` sorts them into their groups. Owns no state.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "default_model")
MAX_BLOCK_SIZE = 256
INT4_GROUP_SIZES = (32, 64, 128)  # layers/int4.py GROUP_SIZES (not imported: no torch here)
MAX_CHAT_TEMPLATE_BYTES = 1 << 20  # --chat-template: the file travels to every stage
CHOICES = {"device": ("auto", "cpu", "cuda"), "dtype": ("auto", "float32", "bfloat16", "float16"),
           "quantization": ("none", "int8", "int4"),
           "preemption_policy": ("newest", "lowest_priority"), "role": ("mixed", "prefill", "decode"),
           "kv_transfer": ("auto", "ipc", "tcp"), "pd_fallback": ("none", "local"),
           "distributed_backend": ("auto", "nccl", "gloo")}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _check_ranges(cfg: msgspec.Struct, ranges: tuple[tuple[str, int, int | None], ...]) -> None:
    for name, lo, hi in ranges:
        v = getattr(cfg, name)
        if v < lo or (hi is not None and v > hi):
            limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{_flag(name)} must be {limit}, got {v}")


def _check_choices(cfg: msgspec.Struct) -> None:
    for name in cfg.__struct_fields__:
        choices = CHOICES.get(name)
        if choices is not None and getattr(cfg, name) not in choices:
            raise ValueError(f"{_flag(name)} must be one of {', '.join(choices)}, got "
                             f"{getattr(cfg, name)!r}")


class ModelConfig(msgspec.Struct, kw_only=True):
    """What runs: the checkpoint, where, in which number format."""
    model: str = DEFAULT_MODEL
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # none | int8 | int4: CPU weights quantised at load, int8 per output channel
    # (layers/lowp.py), int4 in groups of quantization_group_size inputs (layers/int4.py)
    quantization: str = "none"
    quantization_group_size: int = 128  # int4: 32, 64 or 128
    max_model_len: int = 0  # 0: from the checkpoint's config
    seed: int = 0
    # The --chat-template file's text (read once, by config_from_args); None: the checkpoint's.
    chat_template: str | None = None

    def check(self) -> None:
        _check_ranges(self, (("max_model_len", 0, None), ("seed", 0, 2**64 - 1)))
        _check_choices(self)
        if self.chat_template is not None:
            size = len(self.chat_template.encode("utf-8", "surrogatepass"))
            if size > MAX_CHAT_TEMPLATE_BYTES:
                raise ValueError(f"--chat-template: {size} bytes, the limit is "
                                 f"{MAX_CHAT_TEMPLATE_BYTES} bytes")
        if self.quantization != "none" and self.device == "cuda":  # auto: the worker checks
            raise ValueError(f"--quantization {self.quantization} runs on CPU only (the CUDA "
                             f"path has no int8/int4 kernels yet); use --device cpu")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"{_flag('quantization_group_size')} must be one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {self.quantization_group_size}")


class CacheConfig(msgspec.Struct, kw_only=True):
    """The KV cache: its blocks, its size, prefix caching."""
    block_size: int = 0  # 0: 16 on CPU, 64 on GPU
    num_blocks: int = 0  # 0: from the memory budget
    kv_cache_memory: int = 0  # bytes on CPU; 0: sized to the model (worker/kv_sizing.py)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def check(self) -> None:
        _check_ranges(self, (("num_blocks", 0, None), ("kv_cache_memory", 0, None)))
        bs = self.block_size
        if bs and not (0 < bs <= MAX_BLOCK_SIZE and bs & (bs - 1) == 0):
            raise ValueError(f"{_flag('block_size')} must be 0 (automatic) or a power of two up to "
                             f"{MAX_BLOCK_SIZE}, got {bs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"{_flag('gpu_memory_utilization')} must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """How many requests and tokens a step takes, and who is preempted."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: max_num_batched_tokens // 4 ... see scheduler
    preemption_policy: str = "newest"  # newest | lowest_priority
    # In-flight requests beyond max_num_seqs the gateway accepts; more get "queue_full". 0: any.
    max_queued_requests: int = 0

    def check(self) -> None:
        _check_ranges(self, (("max_num_seqs", 1, None), ("max_num_batched_tokens", 1, None),
                             ("long_prefill_token_threshold", 0, None),
                             ("max_queued_requests", 0, None)))
        _check_choices(self)


class ParallelConfig(msgspec.Struct, kw_only=True):
    """Tensor parallelism (models/parallel.py) and the worker's CPU threads: torch.distributed's
    backend (auto: nccl on CUDA, gloo on CPU) and, across hosts, torchrun's names: node 0 runs
    the gateway, every stage and its ranks; node R > 0 only its ranks (tensor_parallel_size /
    nnodes each)."""
    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 on one node: the gateway picks a free one
    worker_threads: int = 0  # CPU: 0 = PIPELINE_WORKER_THREADS, else adaptive from all cores

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def check(self) -> None:
        _check_ranges(self, (("tensor_parallel_size", 1, None), ("nnodes", 1, None),
                             ("node_rank", 0, self.nnodes - 1), ("master_port", 0, 65535),
                             ("worker_threads", 0, None)))
        _check_choices(self)
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp % nodes:
            raise ValueError(f"--tensor-parallel-size {tp} must be a multiple of --nnodes {nodes} "
                             f"(each node runs tensor_parallel_size / nnodes ranks)")
        if nodes > 1 and not self.master_port:
            raise ValueError("--nnodes > 1 needs --master-port (and --master-addr: node 0's address)")


class KVTransferConfig(msgspec.Struct, kw_only=True):
    """Prefill/decode disaggregation (docs/disaggregation.md): this instance's side."""
    role: str = "mixed"  # mixed | prefill | decode
    kv_transfer: str = "auto"  # auto (ipc on one host, else tcp) | ipc | tcp
    kv_listen: str = ""  # decode: where its cache messager takes KV ("": an ipc:// path)
    kv_transfer_timeout: float = 30.0  # s: a reservation that gets no KV by then is freed
    # prefill: a request whose KV did not reach its decode peer fails (none) or is decoded
    # here (local)
    pd_fallback: str = "none"

    def check(self) -> None:
        _check_choices(self)
        if not 0.0 < self.kv_transfer_timeout <= 3600.0:
            raise ValueError(f"--kv-transfer-timeout must be in (0, 3600] seconds, got "
                             f"{self.kv_transfer_timeout}")
        if self.kv_listen and self.role != "decode":
            raise ValueError(f"--kv-listen is for --role decode (where KV is received), not {self.role}")
        if self.kv_listen and not self.kv_listen.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--kv-listen must be tcp://HOST:PORT or ipc://PATH, got {self.kv_listen!r}")
        if self.pd_fallback != "none" and self.role != "prefill":
            raise ValueError(f"--pd-fallback is for --role prefill (where KV is sent), not "
                             f"{self.role}; leave it at none")


GROUPS: dict[str, type[msgspec.Struct]] = {
    "model_config": ModelConfig, "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig, "parallel_config": ParallelConfig,
    "kv_transfer_config": KVTransferConfig}
# flag name (dest) -> its group
FIELD_GROUP: dict[str, str] = {f: g for g, cls in GROUPS.items() for f in cls.__struct_fields__}


class EngineConfig(msgspec.Struct, kw_only=True):
    """Every stage's configuration, in groups that each check their own fields; built from
    flat flag names by ``EngineConfig.of`` (the CLI, ``LLM(**kwargs)``)."""
    model_config: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache_config: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig = msgspec.field(default_factory=KVTransferConfig)
    step_log: str = ""  # a file the engine appends one JSON line per step to (engine/step_log.py)
    instance_id: str = ""

    @classmethod
    def of(cls, **fields: object) -> EngineConfig:
        """From flat flag names (``max_num_seqs=8``, ``role="decode"``); TypeError naming an
        unknown one."""
        groups: dict[str, dict[str, object]] = {g: {} for g in GROUPS}
        top = {}
        for name, v in fields.items():
            g = FIELD_GROUP.get(name)
            if g is not None:
                groups[g][name] = v
            elif name in ("step_log", "instance_id"):
                top[name] = v
            else:
                raise TypeError(f"unknown engine argument {name!r}")
        return cls(**{g: GROUPS[g](**kw) for g, kw in groups.items()}, **top)  # type: ignore[arg-type]

    @staticmethod
    def field_names() -> frozenset[str]:
        """Every flat name ``of`` takes."""
        return frozenset(FIELD_GROUP) | {"step_log", "instance_id"}

    def replace(self, **fields: object) -> EngineConfig:
        """A copy with flat-named fields changed."""
        out = msgspec.structs.replace(self)
        for name, v in fields.items():
            g = FIELD_GROUP.get(name)
            if g is None:
                out = msgspec.structs.replace(out, **{name: v})
            else:
                setattr(out, g, msgspec.structs.replace(getattr(out, g), **{name: v}))
        return out

    def check(self) -> None:
        """Raise ValueError naming the flag and its limit for a value no stage could run with
        (called by ``config_from_args``, before the model loads)."""
        for g in GROUPS:
            getattr(self, g).check()
        if self.step_log and not Path(self.step_log).resolve().parent.is_dir():
            raise ValueError(f"--step-log {self.step_log}: its directory does not exist")
        pd, par = self.kv_transfer_config, self.parallel_config
        if pd.role != "mixed" and par.tensor_parallel_size > 1 and (
                par.nnodes > 1 or self.model_config.device == "cuda"):
            raise ValueError(f"--role {pd.role} with --tensor-parallel-size > 1 runs on one host's "
                             f"CPUs (its ranks share one KV segment that the cache messager ships); "
                             f"got --nnodes {par.nnodes}, --device {self.model_config.device}")

    def resolved_device(self) -> str:
        if self.model_config.device != "auto":
            return self.model_config.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_backend(self) -> str:
        if self.parallel_config.distributed_backend != "auto":
            return self.parallel_config.distributed_backend
        return "nccl" if self.resolved_device() == "cuda" else "gloo"

    def resolved_block_size(self) -> int:
        if self.cache_config.block_size:
            return self.cache_config.block_size
        return 64 if self.resolved_device() == "cuda" else 16


class _Defaults:
    """Every flat flag's default, read by the argparse builders."""

    def __getattr__(self, name: str) -> object:
        g = FIELD_GROUP.get(name)
        return getattr(EngineConfig() if g is None else GROUP_DEFAULTS[g], name)


GROUP_DEFAULTS = {g: cls() for g, cls in GROUPS.items()}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = _Defaults()
    p.add_argument("--model", default=d.model, help="checkpoint directory (Hugging Face format)")
    p.add_argument("--device", default=d.device, choices=CHOICES["device"])
    p.add_argument("--dtype", default=d.dtype, choices=CHOICES["dtype"],
                   help="on CPU, bfloat16 packs the weights as bf16 under float32 activations")
    p.add_argument("--quantization", default=d.quantization, choices=CHOICES["quantization"],
                   help="int8: quantise float weights per output channel at load (CPU); int4: "
                        "in groups of --quantization-group-size inputs (CPU; GPTQ/AWQ checkpoints "
                        "load as int4 whatever this says, unless int8)")
    p.add_argument("--quantization-group-size", type=int, default=d.quantization_group_size,
                   choices=INT4_GROUP_SIZES, help="int4: inputs per scale")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV block: a power of two up to {MAX_BLOCK_SIZE} (0: 16 on CPU, 64 on GPU)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory,
                   help="bytes of KV cache (CPU). Default: as much as the weights take, at least 64 MiB "
                        "and one max_model_len sequence, at most what max_num_seqs sequences of "
                        "max_model_len fill and half the free memory; pages are allocated as used")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
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
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template file that replaces the checkpoint's (at most "
                        f"{MAX_CHAT_TEMPLATE_BYTES >> 20} MiB)")
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


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags; ValueError naming a flag whose value is out of range
    or a --chat-template file that cannot be used (its text is what the config holds)."""
    fields = {f: getattr(a, f) for f in EngineConfig.field_names() if hasattr(a, f)}
    if fields.get("chat_template") is not None:
        fields["chat_template"] = read_chat_template(fields["chat_template"])
    cfg = EngineConfig.of(**fields)
    cfg.check()
    if not cfg.instance_id:
        cfg.instance_id = f"{os.getpid():x}"
    return cfg
