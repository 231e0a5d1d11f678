"""Models: tensor parallelism: which slice of every weight a rank holds, and the collectives
the model calls (over torch.distributed: gloo on CPU, NCCL on CUDA).

The split is Megatron's, as vLLM does it:

- q/k/v and gate/up are column-parallel: rank r holds heads ``[r * H/N, (r+1) * H/N)`` and
  intermediate rows ``[r * I/N, (r+1) * I/N)``; o and down are row-parallel (the matching
  input columns) and end in one all-reduce each per layer. Their biases (o, down) are added
  once: rank 0 holds them, the other ranks zeros.
- KV heads split the same way when there are at least N of them; with fewer (GQA/MQA), each
  rank keeps the one KV head its q heads read (``floor(r * KV / N)``), replicated across the
  ranks that share it, so every rank attends with whole heads and writes a whole KV cache.
- The embedding and the LM head are vocab-parallel: rank r holds rows
  ``[r * Vp, (r+1) * Vp)`` (``Vp = ceil(V / N)``, zero rows past V); a lookup sums the
  ranks' masked rows (all-reduce), the logits are all-gathered (every rank gets the full
  row; rank 0 samples and broadcasts the tokens when sampling is random).

Owns: ``TPShard`` (the arithmetic, no state beyond its numbers) and ``TPGroup`` (this
process's membership of the torch.distributed group: created once by the model runner,
destroyed on close).
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, replace

import torch

from pipeline.models.config import ModelArch


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank ``rank`` of ``size`` over the full model's dimensions."""
    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, mc: ModelArch, rank: int, size: int) -> TPShard:
        """The shard of rank ``rank``; ValueError naming the dimension that ``size`` does not
        divide."""
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
        checks = (("num_attention_heads", mc.num_heads, mc.num_heads % size == 0),
                  ("intermediate_size", mc.intermediate_size, mc.intermediate_size % size == 0),
                  ("num_key_value_heads", mc.num_kv_heads,
                   mc.num_kv_heads % size == 0 or size % mc.num_kv_heads == 0))
        for name, value, ok in checks:
            if not ok:
                raise ValueError(f"--tensor-parallel-size {size} does not split the checkpoint's "
                                 f"{name}={value}" + (" (it must divide it, or be a multiple of it)"
                                                      if name == "num_key_value_heads" else
                                                      " (it must divide it)"))
        return cls(rank, size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size,
                   mc.vocab_size)

    @property
    def heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        return self.rank * self.num_kv_heads // self.size

    @property
    def inter(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def q_rows(self) -> tuple[int, int]:
        n = self.heads * self.head_dim
        return self.rank * n, (self.rank + 1) * n

    def kv_rows(self) -> tuple[int, int]:
        return self.first_kv_head * self.head_dim, (self.first_kv_head + self.kv_heads) * self.head_dim

    def inter_rows(self) -> tuple[int, int]:
        return self.rank * self.inter, (self.rank + 1) * self.inter

    def vocab_rows(self) -> tuple[int, int]:
        """Rows of the full table this rank reads (the rest of its Vp rows are zeros)."""
        return min(self.vocab_start, self.vocab_size), min(self.vocab_start + self.vocab_per_rank,
                                                          self.vocab_size)

    def model_config(self, mc: ModelArch) -> ModelArch:
        """``mc`` with this rank's dimensions: the model built from it has this rank's
        parameter shapes (and ``vocab_size`` = rows of its embedding/LM-head shard)."""
        return replace(mc, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=self.inter, vocab_size=self.vocab_per_rank)


class TPGroup:
    """This process as rank ``rank`` of a torch.distributed group of ``size`` ranks."""

    def __init__(self, shard: TPShard, backend: str, store, where: str, timeout_s: float,
                 device: torch.device) -> None:
        """``store``: the rendezvous every rank has checked in on (worker.tp_rendezvous);
        ``where``: its address, for errors."""
        import torch.distributed as dist
        self.shard, self.rank, self.size = shard, shard.rank, shard.size
        self.device = device
        self.host = socket.gethostname()
        self.hosts = [self.host] * shard.size  # every rank's, once check_same has run
        self.gathered: list[dict[str, str]] = []  # every rank's check_same dict
        self._dist = dist
        self._store = store
        try:
            dist.init_process_group(backend, store=store, rank=shard.rank, world_size=shard.size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - re-raised naming the rank and the host
            raise RuntimeError(f"tensor parallel: rank {shard.rank} on host {self.host} could not "
                               f"join the group of {shard.size} at {where} within "
                               f"{timeout_s:.0f} s: {type(exc).__name__}: {exc}") from None

    def _lost(self, what: str, exc: Exception) -> RuntimeError:
        others = ", ".join(f"rank {r} on {h}" for r, h in enumerate(self.hosts) if r != self.rank)
        return RuntimeError(f"tensor parallel: rank {self.rank} on {self.host} lost the group in "
                            f"{what} (a peer died or is unreachable; the others: {others}): {exc}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        try:
            self._dist.all_reduce(t)
        except RuntimeError as exc:
            raise self._lost("an all-reduce", exc) from None
        return t

    def all_gather_cols(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on every rank -> [rows, size * cols], rank r's columns r-th."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        try:
            self._dist.all_gather(parts, t)
        except RuntimeError as exc:
            raise self._lost("the logits all-gather", exc) from None
        return torch.cat(parts, dim=1)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        try:
            self._dist.broadcast(t, src)
        except RuntimeError as exc:
            raise self._lost("the sampled tokens' broadcast", exc) from None
        return t

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        self._dist.barrier()

    def check_same(self, fields: dict[str, str], own: dict[str, str] | None = None) -> None:
        """Refuse to start when a rank runs another configuration (a node started with another
        model, TP size, block size...): ValueError naming the field, the ranks and hosts.
        ``own``: this rank's values that differ by design, gathered (``gathered``) unchecked."""
        mine = {"host": self.host, **(own or {}), **fields}
        every: list[dict[str, str] | None] = [None] * self.size
        self._dist.all_gather_object(every, mine)
        self.hosts = [str(e["host"]) if e else "?" for e in every]
        self.gathered = [e or {} for e in every]
        ref = every[0]
        assert ref is not None
        for r, other in enumerate(every):
            assert other is not None
            for name in fields:
                if other.get(name) != ref.get(name):
                    raise ValueError(f"tensor parallel: rank {r} on host {other['host']} runs "
                                     f"{name}={other.get(name)!r}, rank 0 on host {ref['host']} "
                                     f"{name}={ref.get(name)!r}; every node must be started with "
                                     f"the same model and engine flags")

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
        self._store = None  # its listening socket (rank 0) closes with it
