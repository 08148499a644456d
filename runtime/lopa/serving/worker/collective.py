"""The collective group of the workers: backend by device, bounded join, the fused broadcast."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lopa.serving.shared.config import BACKENDS_OF_DEVICE, backend_mismatch, split_address
from lopa.serving.shared.group_link import LinkSecurity
from lopa.serving.worker import rendezvous as rendezvous_store

log = logging.getLogger("lopa.worker")


class JoinError(RuntimeError):
    """The group could not be formed within the join timeout."""


def check_backend(backend: str, device: str) -> None:
    """The backend must match the device kind (gloo/cpu, nccl/cuda, hccl/npu)."""
    kind = torch.device(device).type
    if kind not in BACKENDS_OF_DEVICE:
        raise ValueError(f"model.device: unsupported device {device!r} (cpu, cuda or npu)")
    if backend not in BACKENDS_OF_DEVICE[kind]:
        raise ValueError(backend_mismatch(backend, device, kind))


def prepare_device(device: str) -> None:
    """Make `device` current; a bare "cuda" / "npu" (no index) keeps the default one, index 0
    (set_device refuses a device without an index)."""
    target = torch.device(device)
    if target.type == "npu":
        import torch_npu  # noqa: F401  (only on Ascend: registers the npu device and hccl)

        torch.npu.set_device(target.index or 0)  # type: ignore[attr-defined]
    elif target.type == "cuda":
        torch.cuda.set_device(target.index or 0)


def rendezvous_address(address: str) -> tuple[str, int]:
    """(host, port) of workers.rendezvous, brackets of an IPv6 host removed."""
    try:
        host, port = split_address(address)
    except ValueError as error:
        raise ValueError(f"workers.rendezvous: {error}") from None
    return host.strip("[]"), port


def wait_for_dns(host: str, deadline: float) -> None:
    """Peers come up in any order: retry name resolution until the deadline."""
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror as error:
            if time.monotonic() > deadline:
                raise JoinError(f"rendezvous host {host!r} did not resolve: {error}") from None
            time.sleep(0.5)


@dataclass
class Group:
    rank: int
    world_size: int
    backend: str
    group_id: str
    device: torch.device
    _pg: object
    _store_server: object = None  # rank 0: the rendezvous store, kept for the group's life

    def broadcast(self, buffer: torch.Tensor, src: int) -> None:
        """One in-place broadcast; bounded by the step timeout (raises on a lost peer)."""
        if self.world_size > 1:
            dist.broadcast(buffer, src=src, group=self._pg)

def join(
    backend: str,
    rendezvous: str,
    rank: int,
    world_size: int,
    device: str,
    join_timeout_s: float,
    step_timeout_s: float,
    security: LinkSecurity | None = None,
) -> Group:
    """Join the group; every failure (unreachable, missing peer, timeout) raises JoinError in bounded time.

    The rendezvous goes through rank 0's authenticated store (lopa.serving.worker.rendezvous): only
    members that present the group secret (and, with TLS, the group's certificate) take part."""
    security = security or LinkSecurity()
    if not 0 <= rank < world_size:
        raise JoinError(f"rank {rank} outside [0, {world_size})")
    host = rendezvous_address(rendezvous)[0]
    deadline = time.monotonic() + join_timeout_s
    wait_for_dns(host, deadline)
    remaining = max(1.0, deadline - time.monotonic())
    log.info(
        "rank %d/%d joining %s group at %s (timeout %.0fs)", rank, world_size, backend, rendezvous, remaining
    )
    store_server = None
    if rank == 0:
        store_server = rendezvous_store.serve_store(rendezvous_store.bind_address(rendezvous), security)
    try:
        store = rendezvous_store.GroupStore(rendezvous, security, timedelta(seconds=remaining))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=remaining)
        )
        # The step group carries the commits; its shorter timeout bounds a step on a lost peer.
        step_timeout = timedelta(seconds=step_timeout_s)
        pg = dist.new_group(list(range(world_size)), timeout=step_timeout, backend=backend)
        token = [uuid.uuid4().hex if rank == 0 else ""]
        dist.broadcast_object_list(token, src=0)  # one id per group incarnation (the master checks it)
    except (RuntimeError, ValueError, dist.DistStoreError) as error:  # type: ignore[attr-defined]
        if store_server is not None:
            store_server.stop(grace=None)
        message = f"rank {rank}: could not join the {backend} group at {rendezvous}: {error}"
        raise JoinError(message) from error
    log.info("rank %d joined group %s", rank, token[0])
    return Group(rank, world_size, backend, str(token[0]), torch.device(device), pg, store_server)
