"""Shared by every stage: the engine configuration, built once by the entry point.

The gateway parses flags into an EngineConfig, checks it (``EngineConfig.check``, before
anything loads) and hands it (msgspec-encoded) to each stage. Its fields are typed groups with
vLLM's names: ``model_config``, ``cache_config``, ``scheduler_config``, ``parallel_config``,
``kv_transfer_config``, each checking its own fields; the flags stay flat (``--max-num-seqs``,
``LLM(max_num_seqs=...)``) and ``EngineConfig.of`` sorts them into their groups. Owns no state.
"""
from __future__ import annotations

from pathlib import Path

import msgspec

from pipeline.bind import check_bind
from pipeline.config_checks import REASONING_PARSERS, TOOL_CALL_PARSERS
from pipeline.config_checks import check_choices as _check_choices
from pipeline.config_checks import check_ranges as _check_ranges
from pipeline.config_checks import flag as _flag
from pipeline.sizes import parse_size
from pipeline.spec_config import SpeculativeConfig

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "default_model")
MAX_BLOCK_SIZE = 256
INT4_GROUP_SIZES = (32, 64, 128)  # layers/int4.py GROUP_SIZES (not imported: no torch here)
MAX_CHAT_TEMPLATE_BYTES = 1 << 20  # --chat-template: the file travels to every stage

# vLLM's other names for the number formats (--dtype half, LLM(dtype="float")).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

DEFAULT_KV_OFFLOAD_SIZE = 16 << 30
SIZE_FIELDS = ("kv_cache_memory", "kv_offload_size", "kv_offload_host")


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
    # CUDA: run every step eagerly, no captured decode graphs (vLLM's --enforce-eager). CPU
    # steps always run eagerly.
    enforce_eager: bool = False
    # How the model's chat answers are parsed by the front ends (vLLM's flags): tool calls in
    # `tool_call_parser`'s format for tool_choice "auto", `<think>` reasoning.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # Embeddings (LLM.embed, /v1/embeddings): the final-norm hidden states of the prompt pooled
    # as the last token's (last) or their mean (mean), then L2-normalised (worker/pooling.py).
    pooling: str = "last"

    def check(self) -> None:
        _check_ranges(self, (("max_model_len", 0, None), ("seed", 0, 2**64 - 1)))
        _check_choices(self)
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, name) not in (None, *known):
                raise ValueError(f"{_flag(name)} must be one of {', '.join(known)}, got {getattr(self, name)!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model "
                             f"calls tools in: {', '.join(TOOL_CALL_PARSERS)})")
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
    # A second KV tier (docs/kv_tier.md): files under kv_offload_dir, kept to kv_offload_size
    # bytes (0: DEFAULT_KV_OFFLOAD_SIZE); kv_offload_host: pinned host memory (CUDA only).
    kv_offload_dir: str = ""
    kv_offload_size: int = 0
    kv_offload_host: int = 0

    @property
    def kv_offload_bytes(self) -> int:
        """What the --kv-offload-dir tier keeps, its default resolved."""
        return self.kv_offload_size or DEFAULT_KV_OFFLOAD_SIZE

    def check(self) -> None:
        _check_ranges(self, (("num_blocks", 0, None), ("kv_cache_memory", 0, None),
                             ("kv_offload_size", 0, None), ("kv_offload_host", 0, None)))
        if self.kv_offload_size and not self.kv_offload_dir:
            raise ValueError("--kv-offload-size sizes the tier under --kv-offload-dir, which is not set")
        if self.kv_offload_host:
            raise ValueError("--kv-offload-host (a tier in pinned host memory) is for a KV cache "
                             "on CUDA; on CPU the pool already is host memory (give it more with "
                             "--kv-cache-memory), and the CUDA tier is not built yet: use "
                             "--kv-offload-dir")
        if self.kv_offload_dir and not self.enable_prefix_caching:
            raise ValueError("--kv-offload-dir keys its files by the prefix cache's block hashes: "
                             "it needs prefix caching (drop --no-enable-prefix-caching)")
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
    # Speculative decoding (docs/speculative.md); None: off.
    speculative_config: SpeculativeConfig | None = None
    instance_id: str = ""
    # ZMQ CURVE keys (ipc/curve.py's layout) securing every channel this instance opens or
    # accepts: clients, the router, KV transfer, tensor-parallel step plans (docs/security.md).
    curve_keys: str = ""
    # Bind beyond loopback without curve_keys all the same (else refused: check_bind).
    allow_insecure_network: bool = False

    @classmethod
    def of(cls, **fields: object) -> EngineConfig:
        """From flat flag names (``max_num_seqs=8``, ``role="decode"``); TypeError naming an
        unknown one."""
        groups: dict[str, dict[str, object]] = {g: {} for g in GROUPS}
        top = {}
        for name, v in fields.items():
            g = FIELD_GROUP.get(name)
            if name in SIZE_FIELDS and isinstance(v, str):
                try:
                    v = parse_size(v)
                except ValueError as e:
                    raise ValueError(f"{_flag(name)}: {e}") from None
            if name == "dtype" and isinstance(v, str):
                v = DTYPE_ALIASES.get(v, v)
            if name == "speculative_config" and v is not None and not isinstance(v, SpeculativeConfig):
                v = SpeculativeConfig.parse(v)  # type: ignore[arg-type]  # JSON text or a dict
            if g is not None:
                groups[g][name] = v
            elif name in TOP_FIELDS:
                top[name] = v
            else:
                raise TypeError(f"unknown engine argument {name!r}")
        return cls(**{g: GROUPS[g](**kw) for g, kw in groups.items()}, **top)  # type: ignore[arg-type]

    @staticmethod
    def field_names() -> frozenset[str]:
        """Every flat name ``of`` takes."""
        return frozenset(FIELD_GROUP) | frozenset(TOP_FIELDS)

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
        if self.curve_keys:
            missing = [f for f in CURVE_FILES if not (Path(self.curve_keys) / f).is_file()]
            if missing:
                raise ValueError(f"--curve-keys {self.curve_keys}: missing {', '.join(missing)} "
                                 "(make the keys with `pipeline keys DIR`)")
        if self.speculative_config is not None:
            self.speculative_config.check()
        pd, par = self.kv_transfer_config, self.parallel_config
        cc = self.cache_config
        if cc.kv_offload_dir and par.nnodes > 1:
            raise ValueError("--kv-offload-dir with --nnodes > 1: the tier moves the one KV segment "
                             "that the ranks of one host share; across hosts it is not built yet")
        if cc.kv_offload_dir and self.model_config.device == "cuda":
            raise ValueError("--kv-offload-dir with --device cuda: the disk tier moves blocks "
                             "between files and a pool in host memory; from GPU memory it is not "
                             "built yet (docs/kv_tier.md)")
        if pd.kv_listen:  # the decode side's KV listener: who reaches it writes into the cache
            check_bind("--kv-listen", pd.kv_listen, self.curve_keys, self.allow_insecure_network)
        if pd.role != "mixed" and par.tensor_parallel_size > 1 and (
                par.nnodes > 1 or self.model_config.device == "cuda"):
            raise ValueError(f"--role {pd.role} with --tensor-parallel-size > 1 runs on one host's "
                             f"CPUs (its ranks share one KV segment that the cache messager ships); "
                             f"got --nnodes {par.nnodes}, --device {self.model_config.device}")
        if par.nnodes > 1:  # node 0 binds the rendezvous and step-plan ports there
            check_bind("--master-addr", f"tcp://{par.master_addr}:{par.master_port}",
                       self.curve_keys, self.allow_insecure_network)

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


# What a --curve-keys directory holds for an instance to be both ends of its channels.
CURVE_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
# The fields outside the groups (flat names too).
TOP_FIELDS = tuple(f for f in EngineConfig.__struct_fields__ if f not in GROUPS)
