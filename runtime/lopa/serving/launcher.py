"""`lopa serve`: a master and N workers as subprocesses on loopback, supervised as one group.

The children run exactly the commands the operator renders (`lopa master|worker --config FILE`).
A worker that exits takes the group with it (a collective cannot heal): the launcher restarts all
workers with backoff, and the master attaches to the new group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from lopa.host.cpu_budget import usable_cpus
from lopa.serving.client import LopaClient
from lopa.serving.ports import free_ports
from lopa.serving.shared import device_choice
from lopa.serving.shared.config import ServingConfig, WorkersConfig, dump_config
from lopa.serving.shared.listen import PORT_TAKEN_EXIT
from lopa.serving.shared.parent_watch import Lifeline

log = logging.getLogger("lopa.serve")


def worker_threads(workers: int) -> int:
    """torch threads per local worker: the usable cores (a container's CPU limit included) split
    among the workers (the master runs no forwards). A worker with more threads than its share
    slows every other one down."""
    return max(1, usable_cpus() // max(1, workers))


def loopback_config(
    base: ServingConfig, workers: int, listen: str | None = None, worker_port: int = 0,
    rendezvous_port: int = 0,
) -> ServingConfig:
    """base with a master and `workers` workers on free loopback ports, its device and backend resolved
    (auto: this machine's accelerator; gloo when several ranks share one GPU). With TLS the
    master also gets a plaintext health port (unless base has one): the launcher has no client
    certificate, and waits for SERVING there. worker_port: the workers listen on worker_port,
    worker_port + 1, ... instead; rendezvous_port: rank 0's rendezvous (0: free ones)."""
    base = device_choice.resolve(base, ranks_per_device=workers)  # every rank shares this machine's device
    ports = free_ports(workers + 3)
    if rendezvous_port:
        ports[0] = rendezvous_port
    if worker_port:
        ports[1 : workers + 1] = range(worker_port, worker_port + workers)
    listen = listen or f"127.0.0.1:{ports[-1]}"
    health_port = base.master.health_port or (ports[-2] if base.tls.enabled else 0)
    return dataclasses.replace(
        base,
        master=dataclasses.replace(base.master, listen=listen, health_port=health_port),
        workers=WorkersConfig(
            count=workers,
            addresses=tuple(f"127.0.0.1:{p}" for p in ports[1 : workers + 1]),
            listen_port=0,  # each worker listens on the port of its own address
            metrics_port=0,
            backend=base.workers.backend,
            rendezvous=f"127.0.0.1:{ports[0]}",
            join_timeout_s=base.workers.join_timeout_s,
            step_timeout_s=base.workers.step_timeout_s,
            secret_file=base.workers.secret_file,
            tls_cert=base.workers.tls_cert,
            tls_key=base.workers.tls_key,
            tls_ca=base.workers.tls_ca,
        ),
    )


def with_group_secret(config: ServingConfig, path: Path) -> ServingConfig:
    """config with a new random group secret, written to `path` readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as secret:
        secret.write(secrets.token_hex(32))
    return dataclasses.replace(config, workers=dataclasses.replace(config.workers, secret_file=str(path)))


START_TRIES = 3  # starts of a group whose picked ports another process may take


class PortsTaken(RuntimeError):
    """A child could not bind a port picked free for it: another process took it in between."""


class LocalCluster:
    def __init__(
        self, config: ServingConfig, work_dir: Path, log_dir: Path | None = None, own_work_dir: bool = False
    ) -> None:
        """own_work_dir: the children remove work_dir if this process dies without stopping them.
        A config without workers.secret_file gets a fresh group secret in work_dir (owner-only)."""
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if not config.workers.secret_file:
            config = with_group_secret(config, self.work_dir / "group-secret")
        self.config = config
        self.log_dir = log_dir
        self.config_path = self.work_dir / "lopa.yaml"
        self.config_path.write_text(dump_config(config))
        self.master: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []
        self.restarts = 0
        self.own_work_dir = own_work_dir
        self.lifeline: Lifeline | None = None  # opened with the first child, closed by stop()

    @property
    def address(self) -> str:
        return self.config.master.listen

    @property
    def health_address(self) -> str:
        """Where wait_serving asks: the client API, or under TLS the master's plaintext health port."""
        if self.config.tls.enabled and self.config.master.health_port:
            return f"127.0.0.1:{self.config.master.health_port}"
        return self.address

    def _spawn(self, role: str, *extra: str, threads: int = 1) -> subprocess.Popen:
        out: IO[bytes] | None = None
        if self.log_dir is not None:
            name = role if not extra else f"{role}-{extra[-1]}"
            out = open(self.log_path(name), "ab")  # noqa: SIM115 (closed in stop())
            self._logs.append(out)
        if self.lifeline is None:
            self.lifeline = Lifeline(str(self.work_dir) if self.own_work_dir else None)
        env = self.lifeline.child_env(dict(os.environ))
        env.setdefault("OMP_NUM_THREADS", str(threads))  # the processes share the CPU cores
        # The collective's own sockets (gloo's pairs, NCCL's bootstrap) on loopback too: every
        # internal port of a local group stays on this host.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        command = [sys.executable, "-m", "lopa", role, "--config", str(self.config_path), *extra]
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                pass_fds=(self.lifeline.read_fd,),
                                start_new_session=True)  # the launcher alone decides when children stop

    def log_path(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.log"

    def last_words(self, name: str) -> str:
        """'; its log worker-0.log ends: <last line>' when the children log to files (otherwise
        their errors already went to this process's stderr)."""
        if self.log_dir is None:
            return ""
        path = self.log_path(name)
        try:
            lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return f"; see {path}"
        return f"; {path} ends: {lines[-1].strip()}" if lines else f"; {path} is empty"

    def start_workers(self) -> None:
        count = self.config.workers.count
        threads = worker_threads(count)
        self.workers = [self._spawn("worker", "--rank", str(r), threads=threads) for r in range(count)]

    def stop_workers(self, timeout: float = 10.0) -> None:
        _terminate(self.workers, timeout)
        self.workers = []

    def restart_workers(self) -> None:
        self.stop_workers()
        self.restarts += 1
        self.start_workers()

    def start(self, timeout: float = 300.0) -> str:
        self.start_workers()
        self.master = self._spawn("master")
        if not self.wait_serving(timeout, strict=True):
            self.stop()
            raise RuntimeError(f"the master at {self.address} did not become SERVING within {timeout:.0f}s")
        return self.address

    def start_on_free_ports(self, pick: Callable[[], ServingConfig], timeout: float = 300.0) -> str:
        """start(); when a child exits because a port picked free for it was taken before it bound
        it (by another process), `pick` gives the config on new free ports and the group starts
        again, up to START_TRIES starts."""
        for _ in range(START_TRIES - 1):
            try:
                return self.start(timeout)
            except PortsTaken as error:
                log.warning("%s; starting again on new ports", error)
                _terminate([p for p in [self.master] if p is not None], timeout=10.0)
                self.master = None
                self.stop_workers()
                self._write_config(pick())
        return self.start(timeout)

    def _write_config(self, config: ServingConfig) -> None:
        """Use `config` from the next start on (its group secret: this cluster's, unless it names one)."""
        if not config.workers.secret_file:
            workers = dataclasses.replace(config.workers, secret_file=self.config.workers.secret_file)
            config = dataclasses.replace(config, workers=workers)
        self.config = config
        self.config_path.write_text(dump_config(config))

    def wait_serving(self, timeout: float, strict: bool = False) -> bool:
        """Poll health until SERVING; strict: a worker that exits (during start-up) is an error."""
        deadline = time.monotonic() + timeout
        with LopaClient(self.health_address) as client:
            while time.monotonic() < deadline:
                if self.master is not None and self.master.poll() is not None:
                    code = self.master.returncode
                    message = f"the master exited ({exit_status(code)}){self.last_words('master')}"
                    raise PortsTaken(message) if code == PORT_TAKEN_EXIT else RuntimeError(message)
                # Any exit, 0 included: before the group formed no worker has a reason to leave, and
                # one that did would leave this wait running to its deadline.
                failed = [(r, p.returncode) for r, p in enumerate(self.workers) if p.poll() is not None]
                if strict and failed:
                    exits, words = describe_exits(failed), self.last_words(f"worker-{failed[0][0]}")
                    message = f"worker(s) exited before the group formed: {exits}{words}"
                    taken = any(code == PORT_TAKEN_EXIT for _, code in failed)
                    raise PortsTaken(message) if taken else RuntimeError(message)
                if client.health(timeout=2.0) == "SERVING":
                    return True
                time.sleep(0.25)
        return False

    def supervise(
        self, poll_s: float = 0.5, max_backoff_s: float = 30.0, stop: threading.Event | None = None
    ) -> int:
        """Block until `stop` is set (returns 0); RuntimeError when the master exits (it only stops
        when told to, so that is a failure: the caller stops the workers).

        A dead worker restarts the whole group; the backoff doubles per quick re-failure up to
        max_backoff_s, and a minute of health resets it."""
        backoff, restarted_at = 1.0, 0.0
        while stop is None or not stop.is_set():
            if self.master is not None and self.master.poll() is not None:
                code = exit_status(self.master.returncode)
                raise RuntimeError(f"the master exited ({code}); stopping the workers")
            dead = [(r, p.returncode) for r, p in enumerate(self.workers) if p.poll() is not None]
            if dead:
                if time.monotonic() - restarted_at > 60.0:
                    backoff = 1.0
                log.error("%s: restarting the group in %.0fs", describe_exits(dead), backoff)
                time.sleep(backoff)
                self.restart_workers()
                restarted_at, backoff = time.monotonic(), min(max_backoff_s, backoff * 2)
            time.sleep(poll_s)
        return 0

    def signal_master(self, signum: int) -> None:
        """SIGTERM: the master drains (lopa master); SIGINT: it stops at once."""
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signum)

    def master_running(self) -> bool:
        return self.master is not None and self.master.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        _terminate([p for p in [self.master] if p is not None], timeout)
        self.stop_workers(timeout)
        for f in self._logs:
            f.close()
        self._logs = []
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None


def exit_status(returncode: int) -> str:
    """'code 3' or 'killed by SIGKILL' (Popen reports a signal as a negative code)."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def describe_exits(exits: list[tuple[int, int]]) -> str:
    """'rank 0 exited with code 3, rank 1 killed by SIGKILL' for [(rank, returncode), ...]."""
    return ", ".join(
        f"rank {rank} " + ("exited with " if code >= 0 else "") + exit_status(code) for rank, code in exits
    )


def _terminate(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
