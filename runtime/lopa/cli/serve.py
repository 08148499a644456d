"""`lopa serve --workers N`: a local master + N branch workers on loopback, on the accelerator it finds."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from lopa.cli.decoding_flags import add_decoding_flags, params_from_args
from lopa.cli.preflight import device_problem, listen_problem, weights_problem
from lopa.params import InvalidParameter
from lopa.serving.ports import port_pool
from lopa.serving.shared import device_choice
from lopa.serving.shared.config import (
    API_KEY_ENV,
    DTYPES,
    MAX_BATCH,
    MAX_PORT,
    MAX_SECONDS,
    WEIGHTS,
    ConfigError,
    ModelConfig,
    ServingConfig,
    load_config,
    parse_config,
    split_address,
    validate,
    with_model_defaults,
)
from lopa.serving.shared.model_dir import model_path, usable_max_length

if TYPE_CHECKING:
    from lopa.serving.launcher import LocalCluster

log = logging.getLogger("lopa.serve")
DOWNLOAD_DIR = "~/.cache/lopa/models"
# Beyond the drain bound, for the master to end what is left and exit (the operator's pods have the
# same margin in their grace period).
DRAIN_MARGIN_S = 15.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # long: the flags of `lopa serve`, one after another
    parser = subparsers.add_parser(
        "serve",
        help="start a local master and N branch workers (subprocesses on loopback)",
        description="Start `lopa master` and N `lopa worker`s on loopback, wait until SERVING, print the "
        "address; Ctrl-C stops everything. A worker that dies restarts the whole group.",
    )
    parser.add_argument("--workers", type=int, default=None,
                        help="branch workers (collective world size; default: the config file's "
                        "workers.count, else 2)")
    parser.add_argument("--config", default=None,
                        help="base serving YAML (addresses, the workers' ports and master.metrics_port are "
                        "replaced, --http-port replaces master.http_port when given; with tls, the master "
                        "gets a plaintext master.health_port, where this command waits for SERVING)")
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory or hf://org/name[@revision] (fetched into --download-dir "
                        "once), as vLLM's `vllm serve MODEL`; the same as --model")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory")
    parser.add_argument("--download-dir", default=DOWNLOAD_DIR,
                        help="where an hf:// MODEL is fetched, under <org>/<name>/<revision> (default: "
                        "%(default)s)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="weights dtype (default: the config file's model.dtype, else float32)")
    parser.add_argument("--weights", default=None, choices=WEIGHTS,
                        help="linear weights: dtype (as --dtype) or fp8 (e4m3, per-channel scales; a GPU of "
                        "compute capability >= 8.9, or the CPU) (default: the config file's model.weights, "
                        "else dtype)")
    parser.add_argument("--device", default=None,
                        help="auto, cpu, cuda[:N] or npu[:N]; auto: CUDA when present, then an NPU, else the "
                        "CPU (default: the config file's model.device, else auto)")
    parser.add_argument("--listen", default="127.0.0.1:50051",
                        help="client API address, HOST:PORT; the HTTP API and the metrics listen on its host "
                        "too (default: %(default)s, loopback only)")
    parser.add_argument("--all-interfaces", action="store_true",
                        help="listen on every interface (0.0.0.0) with the client API, the HTTP API and the "
                        "metrics, reachable from other hosts; the workers stay on loopback (default: off)")
    parser.add_argument("--http-port", type=int, default=0,
                        help="serve the OpenAI-compatible HTTP API on this port too (default: the config's "
                        "master.http_port, else 0 = off)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="requests decoded at once, one KV cache each (default: the config's "
                        "limits.max_batch, else 8)")
    parser.add_argument("--max-step-tokens", type=int, default=None,
                        help="branch budget: tokens of one forward per worker (default: the config's "
                        "limits.max_step_tokens, else the device's: "
                        "cpu a base row and one lookahead row per running request, "
                        "cuda/npu measured at start)")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds to wait for SERVING (default: %(default).0f)")
    parser.add_argument(
        "--prompt", default=None, help="one-shot: send this prompt, print the answer and its stats, stop"
    )
    parser.add_argument("--logs", default=None,
                        help="directory for the children's logs, created if missing (default: inherit)")
    add_port_flags(parser)
    add_vllm_flags(parser)
    add_decoding_flags(parser)
    parser.set_defaults(handler=run)


def add_port_flags(parser: argparse.ArgumentParser) -> None:
    """The group's other ports (every port is free when left at 0)."""
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="master Prometheus metrics port (default: 0 = no metrics endpoint)")
    parser.add_argument("--worker-port", type=int, default=0,
                        help="the workers listen on this port and the next ones, one each, on loopback "
                        "(default: 0 = free ports, from LOPA_PORT_RANGE=LOW-HIGH when set)")
    parser.add_argument("--rendezvous-port", type=int, default=0,
                        help="the workers' rendezvous port, on loopback (default: 0 = a free port, from "
                        "LOPA_PORT_RANGE when set)")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's `vllm serve` flags, where lopa has their meaning (docs/guides/coming-from-vllm.md)."""
    parser.add_argument("--host", default=None,
                        help="the host every client-facing port binds, as vLLM's (replaces --listen's host)")
    parser.add_argument("--port", type=int, default=None,
                        help="the OpenAI-compatible HTTP API's port, as vLLM's --port (as --http-port)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model ids the HTTP API answers to, the first the main one (default: the "
                        "config's master.model_name, else the model directory's name)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the longest prompt + answer of a request, in tokens (the KV cache of each "
                        "request; default: limits.max_prompt_tokens + limits.max_new_tokens, at most the "
                        "model's positions)")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help=f"require one of these keys (Authorization: Bearer KEY) on the HTTP API's paths "
                        "but the probes, /version and /metrics, and on the gRPC API but health (default: "
                        f"{API_KEY_ENV} of the environment, else none)")
    parser.add_argument("--no-access-log", action="store_true",
                        help="no line per HTTP request in the master's log (default: one line each, "
                        "without the prompt)")


def run(args: argparse.Namespace) -> int:

    check_flags(args)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = serving_config(args)
    if args.prompt is not None and config.tls.enabled:
        raise InvalidParameter("prompt", "sends its request without TLS, and the config file sets tls: "
                               "start without --prompt and use `lopa client generate --ca ...`")
    # SIGTERM (a process manager, `kill`) stops the group like Ctrl-C: children never outlive us.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    from lopa.serving.launcher import LocalCluster

    with tempfile.TemporaryDirectory(prefix="lopa-serve-") as tmp:
        # own_work_dir: killed outright (SIGKILL), this process cannot remove tmp; its children do.
        cluster = LocalCluster(config, Path(tmp), Path(args.logs) if args.logs else None, own_work_dir=True)
        try:
            address = cluster.start_on_free_ports(lambda: serving_config(args), timeout=args.start_timeout)
            if args.prompt is not None:
                return one_shot(address, args.prompt, config.workers.count)
            host, port = address.rpartition(":")[0], config.master.http_port
            http = f", HTTP (OpenAI API) on {host}:{port}" if port else ""
            workers = config.workers.count
            print(f"lopa: serving on {address}{http} with {workers} workers (Ctrl-C to stop)", flush=True)
            return cluster.supervise()
        except KeyboardInterrupt:
            return drain(cluster, config.limits.request_timeout_s)
        except RuntimeError as error:
            print(f"lopa serve: error: {error}", file=sys.stderr)
            return 1
        finally:
            cluster.stop()


def check_flags(args: argparse.Namespace) -> None:
    """The flags that config validation would report under a config key, or the children too late.
    --all-interfaces replaces the host of --listen with 0.0.0.0, --host with its own; vLLM's
    spellings (MODEL, --port, --api-key) become lopa's."""
    vllm_flags(args)
    if args.all_interfaces:
        args.listen = f"0.0.0.0:{args.listen.rpartition(':')[2]}"
    if args.prompt is not None and not args.prompt.strip():
        raise InvalidParameter("prompt", "is empty")
    if args.workers is not None and args.workers < 1:
        raise InvalidParameter("workers", f"must be >= 1, got {args.workers}")
    if args.max_batch is not None and not 1 <= args.max_batch <= MAX_BATCH:
        raise InvalidParameter("max_batch", f"must be in [1, {MAX_BATCH}], got {args.max_batch}")
    if args.max_step_tokens is not None and args.max_step_tokens < 0:
        got = args.max_step_tokens
        raise InvalidParameter("max_step_tokens", f"must be >= 0 (0 = the device's default), got {got}")
    if not 0 <= args.http_port <= MAX_PORT:
        raise InvalidParameter("http_port", f"must be in [0, {MAX_PORT}], got {args.http_port}")
    for flag in ("metrics_port", "worker_port", "rendezvous_port"):
        if not 0 <= getattr(args, flag) <= MAX_PORT:
            raise InvalidParameter(flag, f"must be in [0, {MAX_PORT}], got {getattr(args, flag)}")
    if not 0 < args.start_timeout <= MAX_SECONDS:  # also refuses NaN
        got = args.start_timeout
        raise InvalidParameter("start_timeout", f"must be in (0, {MAX_SECONDS:.0f}] seconds, got {got:g}")
    problem = listen_problem(args.listen)
    if problem:
        raise InvalidParameter("listen", problem)
    _check_ports(args)
    if args.logs:
        _make_log_dir(Path(args.logs))


def vllm_flags(args: argparse.Namespace) -> None:
    """MODEL (a directory, or an hf:// URI fetched here), --host, --port and --api-key, as lopa's
    --model, --listen's host, --http-port and the master's LOPA_API_KEY."""
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            twice = f"MODEL {args.model_arg!r} and --model {args.model!r}"
            raise InvalidParameter("model", f"given twice: {twice}")
        uri = "://" in args.model_arg
        args.model = fetched(args.model_arg, Path(args.download_dir).expanduser()) if uri else args.model_arg
    if args.host is not None:
        if args.all_interfaces:
            raise InvalidParameter("host", "and --all-interfaces both choose the host: give one")
        args.listen = f"{args.host}:{args.listen.rpartition(':')[2]}"
    if args.port is not None:
        if args.http_port and args.http_port != args.port:
            ports = f"({args.port}, {args.http_port})"
            raise InvalidParameter("port", f"and --http-port name different ports {ports}")
        args.http_port = args.port
    if args.api_key is not None:
        bad = [key for key in args.api_key if not key.strip() or "," in key]
        if bad:
            raise InvalidParameter("api_key", "a key must be non-empty and hold no comma")
        os.environ[API_KEY_ENV] = ",".join(args.api_key)  # the master inherits it
    for name in args.served_model_name or ():
        if not name.strip():
            raise InvalidParameter("served_model_name", "a name must be non-empty")
    if args.max_model_len is not None and args.max_model_len < 2:
        got = args.max_model_len
        raise InvalidParameter("max_model_len", f"must be >= 2 (a prompt token and an answer), got {got}")


def fetched(uri: str, download_dir: Path) -> str:
    """An hf:// MODEL's directory once it holds the revision (lopa fetch-model's fetch)."""
    from lopa import hub

    try:
        model = hub.parse(uri)
        into = download_dir / model.repo / model.revision
        print(f"lopa: fetching {uri} into {into}", file=sys.stderr, flush=True)
        result = hub.fetch(uri, into)
    except hub.FetchError as error:
        raise InvalidParameter("model", str(error)) from None
    state = "downloaded" if result.downloaded else "already there"
    print(f"lopa: {uri} at {result.commit[:12]} {state}", file=sys.stderr, flush=True)
    return str(result.path)


def _make_log_dir(path: Path) -> None:
    """--logs, created (a first run's directory need not exist); InvalidParameter naming the flag."""
    if path.exists() and not path.is_dir():
        raise InvalidParameter("logs", f"{path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidParameter("logs", f"cannot create {path}: {error.strerror or error}") from None


def _check_ports(args: argparse.Namespace) -> None:
    """--http-port and --metrics-port (the master listens on --listen's host) free and apart from
    --listen's port, reported under their flags before any child starts (the master would name its
    config key). LOPA_PORT_RANGE, which the free ones come from, is checked here too."""
    port_pool()
    host, port = split_address(args.listen)  # checked by listen_problem first
    taken = {"listen": port}
    for flag in ("http_port", "metrics_port", "rendezvous_port"):
        port = getattr(args, flag)
        if not port:
            continue
        for other, used in taken.items():
            if port == used:
                raise InvalidParameter(flag, f"must differ from --{other.replace('_', '-')} (both {port})")
        problem = listen_problem(f"{'127.0.0.1' if flag == 'rendezvous_port' else host}:{port}")
        if problem:
            raise InvalidParameter(flag, problem)
        taken[flag] = port
    _check_worker_ports(args, taken)


def _check_worker_ports(args: argparse.Namespace, taken: dict[str, int]) -> None:
    """--worker-port and the ports after it, one per worker: free, in range and apart from the others."""
    if not args.worker_port:
        return
    count = args.workers or 2
    ports = range(args.worker_port, args.worker_port + count)
    if ports[-1] > MAX_PORT:
        needed = f"{count} workers need ports {ports[0]}-{ports[-1]}"
        raise InvalidParameter("worker_port", f"{needed}, past {MAX_PORT}")
    for flag, used in taken.items():
        if used in ports:
            raise InvalidParameter("worker_port", f"the workers' ports {ports[0]}-{ports[-1]} hold --"
                                                  f"{flag.replace('_', '-')}'s {used}")
    for port in ports:
        problem = listen_problem(f"127.0.0.1:{port}")
        if problem:
            raise InvalidParameter("worker_port", problem)


def serving_config(args: argparse.Namespace) -> ServingConfig:
    """The config the children get: the file (or defaults), the model flags, the decoding flags on top of
    the file's decoding keys and the model's own defaults, loopback addresses; validated."""
    # long: every flag onto its config key, in one place
    from lopa.serving.launcher import loopback_config

    base = load_config(args.config, local=True) if args.config else parse_config({})
    model = ModelConfig(path=args.model or base.model.path, adapter=args.adapter or base.model.adapter,
                        dtype=args.dtype or base.model.dtype, device=args.device or base.model.device,
                        weights=args.weights or base.model.weights)
    problem = device_problem(model.device)
    if problem:
        if args.device:
            raise InvalidParameter("device", problem)
        raise ConfigError(f"model.device: {problem}")
    problem = weights_problem(model.weights, model.device)
    if problem:
        raise ConfigError(f"model.weights: {problem}")
    try:
        path = model_path(model.path)
    except ConfigError as error:
        if args.model:  # the flag (or MODEL) named it: say so, not the config key
            reason = f"{args.model!r} is not a checkpoint directory (no config.json)"
            raise InvalidParameter("model", reason) from None
        raise error
    base = with_model_defaults(dataclasses.replace(base, model=model), path)
    decoding = params_from_args(args, base.decoding)
    limits = base.limits
    # The flags (or the model's defaults) ask for more than the file's limits: this server is the user's
    # own, so the limits grow to fit.
    if decoding.max_new_tokens > limits.max_new_tokens or decoding.branches > limits.max_branches:
        limits = dataclasses.replace(
            limits,
            max_new_tokens=max(limits.max_new_tokens, decoding.max_new_tokens),
            max_branches=max(limits.max_branches, decoding.branches),
        )
    if args.max_batch is not None:
        limits = dataclasses.replace(limits, max_batch=args.max_batch)
    if args.max_step_tokens is not None:
        limits = dataclasses.replace(limits, max_step_tokens=args.max_step_tokens)
    if args.max_model_len is not None:
        limits = dataclasses.replace(limits, max_model_len=args.max_model_len)
    master = dataclasses.replace(base.master, metrics_port=args.metrics_port,
                                 http_port=args.http_port or base.master.http_port)
    if args.served_model_name:
        names = args.served_model_name
        master = dataclasses.replace(master, model_name=names[0], model_aliases=tuple(names[1:]))
    if args.no_access_log:
        master = dataclasses.replace(master, access_log=False)
    config = dataclasses.replace(base, decoding=decoding, limits=limits, master=master)
    workers = args.workers if args.workers is not None else (base.workers.count if _sets_count(args) else 2)
    ports = args.worker_port, args.rendezvous_port
    given, config = config, loopback_config(config, workers, args.listen, *ports)
    log.info("%s", device_choice.start_line(config, given))
    validate(config)
    usable_max_length(config, model_path(model.path))  # what the children would refuse, refused now
    return config


def _sets_count(args: argparse.Namespace) -> bool:
    """The config file sets workers.count (else `lopa serve` runs 2 workers, as without a file)."""
    import yaml

    if not args.config:
        return False
    raw = yaml.safe_load(Path(args.config).read_text())  # already loaded once: it parses
    return isinstance(raw, dict) and isinstance(raw.get("workers"), dict) and "count" in raw["workers"]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def drain(cluster: LocalCluster, bound_s: float) -> int:
    """The first Ctrl-C (or SIGTERM): the master drains as a pod's does (no new request, the queued
    and running ones finish, for at most limits.request_timeout_s; then each request still open ends
    with its error), with its workers serving it to the end. Another Ctrl-C or SIGTERM stops now:
    every open request ends with its error at once."""
    print(f"lopa: draining, at most {bound_s:g} s (limits.request_timeout_s); Ctrl-C again stops now",
          flush=True)
    urgent = threading.Event()

    def again(signum: int, frame: object) -> None:
        urgent.set()

    signal.signal(signal.SIGINT, again)
    signal.signal(signal.SIGTERM, again)
    cluster.signal_master(signal.SIGTERM)
    deadline = time.monotonic() + bound_s + DRAIN_MARGIN_S
    while cluster.master_running() and time.monotonic() < deadline:
        if urgent.is_set():
            urgent.clear()
            print("lopa: stopping now", flush=True)
            cluster.signal_master(signal.SIGINT)
            deadline = min(deadline, time.monotonic() + DRAIN_MARGIN_S)
        time.sleep(0.05)
    print("lopa: stopped", flush=True)
    return 0


def one_shot(address: str, prompt: str, workers: int) -> int:
    """The README's demo: one request through the master, answer on stdout, stats on stderr."""
    from lopa.serving.client import LopaClient

    with LopaClient(address) as client:
        try:
            reply = client.generate(prompt, timeout=600)
        except grpc.RpcError as error:
            print(f"lopa serve: error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    s = reply.stats
    print(reply.text)
    print(
        f"-- {s.tokens} tokens in {s.forwards} forwards over {workers} workers: TPF {s.tpf:.2f}, "
        f"{s.tokens_per_s:.1f} tokens/s, {s.wall_s:.3f} s wall (prefill included), "
        f"ttft {s.ttft_s:.3f} s, finish: {reply.finish_reason}",
        file=sys.stderr,
    )
    return 0
