"""Worker stage: where the tensor-parallel ranks meet (torch.distributed's rendezvous store)
and what each port needs before anything loads.

torch's own ``tcp://`` rendezvous binds its TCPStore on every interface and, when the port
is taken, retries until the group's timeout ("could not join ... within 120 s"). Here rank 0
binds the listening socket itself and hands it to the store (``master_listen_fd``):

- on one host (``--nnodes 1``) to 127.0.0.1 only, and gloo/NCCL's own sockets to the
  loopback interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless set), so
  nothing of the group listens beyond loopback;
- across hosts to ``--master-addr`` only (not every interface);
- a port in use fails at once, naming the flag and the port (``probe_port``, which the
  gateway also runs before it starts any stage, for the step-plan port too).

Rank 0 then waits for every rank to check in on the store while ``watch`` says its peers
are alive (``pipeline.LLM`` passes one that names a rank process that died), so a rank that
never starts fails the start at once instead of after the timeout.

Owns nothing beyond the socket it hands to the store.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable

from pipeline.config import ParallelConfig

JOINED = "pipeline/joined"
LOOPBACK = "127.0.0.1"
WATCH_S = 0.1  # how often rank 0 counts the ranks checked in while the others come


def store_host(par: ParallelConfig) -> str:
    """Where rank 0's store listens: loopback on one host, --master-addr across hosts."""
    return LOOPBACK if par.nnodes == 1 else par.master_addr


def listen_socket(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening; ValueError naming ``flag`` (the flag
    and its value) if taken."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a previous run only
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ValueError(f"tensor parallel: {flag}: cannot listen on {host}:{port} "
                         f"({exc.strerror or exc}); another process holds it: stop it or give "
                         f"another --master-port") from None
    return sock


def probe_port(host: str, port: int, flag: str) -> None:
    """Fail now (ValueError naming ``flag``) if ``host:port`` cannot be bound."""
    listen_socket(host, port, flag).close()


def probe_master_ports(par: ParallelConfig) -> None:
    """Node 0, before any stage starts: the rendezvous port and, across hosts, the step-plan
    port (``--master-port + 1``, worker.remote_plan) are free."""
    if par.tensor_parallel_size == 1 or par.node_rank != 0 or not par.master_port:
        return
    probe_port(store_host(par), par.master_port, f"--master-port {par.master_port}")
    if par.nnodes > 1:
        probe_port(par.master_addr, par.master_port + 1,
                   f"--master-port {par.master_port} (+ 1, the step-plan port)")


def open_store(par: ParallelConfig, rank: int, timeout_s: float,
               watch: Callable[[float], None] | None = None):  # -> torch.distributed.TCPStore
    """This rank's handle on the group's store, every rank checked in when it returns.
    ``watch(seconds)`` waits up to that long and raises once a peer is known dead (rank 0)."""
    import torch.distributed as dist
    host, size = store_host(par), par.tensor_parallel_size
    timeout = datetime.timedelta(seconds=timeout_s)
    if par.nnodes == 1:  # gloo and NCCL listen on the interface they pick: loopback here
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if rank != 0:
        try:
            store = dist.TCPStore(host, par.master_port, size, False, timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised naming where and how long
            raise RuntimeError(f"tensor parallel: rank {rank} could not reach rank 0's store at "
                               f"{host}:{par.master_port} within {timeout_s:.0f} s: {exc}") from None
        store.add(JOINED, 1)
        return store
    sock = listen_socket(host, par.master_port, f"--master-port {par.master_port}")
    # The store takes over the descriptor (detach: Python must not close it under it).
    store = dist.TCPStore(host, par.master_port, size, True, timeout, wait_for_workers=False,
                          master_listen_fd=sock.detach())
    store.add(JOINED, 1)
    deadline = time.monotonic() + timeout_s
    while (joined := store.add(JOINED, 0)) < size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor parallel: rank 0 on host {socket.gethostname()} could not "
                               f"join the group of {size} at {host}:{par.master_port} within "
                               f"{timeout_s:.0f} s: {size - joined} of the other ranks never came")
        # Not store.wait: its time-outs print a c10d warning each.
        if watch is not None:
            watch(WATCH_S)
        else:
            time.sleep(WATCH_S)
    return store
