"""`lopa bench serving`: step time split (forward / coordination / commit) and tokens/s on loopback.

For each worker count it starts a LocalCluster (the `lopa serve` launcher), reads the split from the
master's Prometheus histograms (so the numbers are the ones production exports), and measures
tokens/s for one request at a time and for N concurrent requests (queued: the workers hold one).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lopa.bench.rows import finish, show_row
from lopa.serving.client import LopaClient
from lopa.serving.config import MasterConfig, ServingConfig, parse_config
from lopa.serving.launcher import LocalCluster, free_ports, loopback_config

PHASES = ("forward", "coordination", "commit")
PROMPTS = ["12+34=", "Write a haiku about the sea.", "def fib(n):", "The capital of France is"]
WARMUP = 2  # requests before the measured ones (their steps are not counted)


def scrape(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of lopa_step_seconds per phase."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {phase: [0.0, 0.0] for phase in PHASES}
    for family in text_string_to_metric_families(text):
        if family.name != "lopa_step_seconds":
            continue
        for sample in family.samples:
            phase = sample.labels.get("phase")
            if phase in out and sample.name.endswith("_sum"):
                out[phase][0] = sample.value
            elif phase in out and sample.name.endswith("_count"):
                out[phase][1] = sample.value
    return {phase: (s, c) for phase, (s, c) in out.items()}


def step_split(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per step of each phase between two scrapes."""
    out = {}
    for phase in PHASES:
        steps = after[phase][1] - before[phase][1]
        out[phase] = 1000 * (after[phase][0] - before[phase][0]) / steps if steps else 0.0
    return out


def bench_workers(
    config: ServingConfig, workers: int, requests: int, concurrency: int, kw: dict,
    prompts: Sequence[str] = PROMPTS,
) -> dict:
    """One worker count; prompts[:WARMUP] warm up, the measured requests cycle through the rest."""
    warmup, measured = list(prompts[:WARMUP]), list(prompts[WARMUP:]) or list(prompts)
    metrics_port = free_ports(1)[0]
    config = dataclasses.replace(config, master=MasterConfig(metrics_port=metrics_port))
    config = loopback_config(config, workers)
    with tempfile.TemporaryDirectory(prefix="lopa-bench-") as tmp:
        cluster = LocalCluster(config, Path(tmp), log_dir=Path(tmp))
        cluster.start()
        try:
            with LopaClient(cluster.address) as client:
                for prompt in warmup:
                    client.generate(prompt, timeout=600, **kw)
                before = scrape(metrics_port)
                tokens, wall, steps = 0, 0.0, 0
                for i in range(requests):
                    stats = client.generate(measured[i % len(measured)], timeout=600, **kw).stats
                    tokens, wall, steps = tokens + stats.tokens, wall + stats.wall_s, steps + stats.forwards
                split = step_split(before, scrape(metrics_port))
                began = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    replies = list(pool.map(
                        lambda i: client.generate(measured[i % len(measured)], timeout=600, **kw),
                        range(concurrency),
                    ))
                elapsed = time.perf_counter() - began
        finally:
            cluster.stop()
    step_ms = 1000 * wall / steps if steps else 0.0
    overhead = split["coordination"] + split["commit"]
    return {
        "workers": workers,
        "step_ms": round(step_ms, 3),
        **{f"{p}_ms": round(v, 3) for p, v in split.items()},
        "overhead_ms": round(overhead, 3),
        "overhead_pct": round(100 * overhead / step_ms, 1) if step_ms else 0.0,
        "tpf": round(tokens / steps, 3) if steps else 0.0,
        "tokens_per_s_single": round(tokens / wall, 1) if wall else 0.0,
        f"tokens_per_s_{concurrency}_concurrent": round(sum(r.stats.tokens for r in replies) / elapsed, 1),
    }


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "serving",
        help="branch-parallel serving on loopback: step time split and tokens/s per worker count",
        description="Start master + N workers for each N; report forward / coordination / commit per step "
        "and tokens/s for one request and for concurrent ones.",
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument(
        "--synthetic", action="store_true",
        help="use a random 4-layer model (hidden 256, vocab 2048) instead: the transport, not the model",
    )
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--requests", type=int, default=8, help="sequential requests per worker count")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--attention", default=None, choices=["full", "block_causal"],
                        help="default: the bundled model's default, else full")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: the bundled model's default, else 64")
    parser.add_argument("--block-size", type=int, default=None, help="default: the model's (server) default")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.set_defaults(handler=run)


def synthetic_model(directory: Path) -> Path:
    """A random Dream checkpoint big enough that a step is mostly forward, small enough for CPU."""
    from safetensors.torch import save_file

    from lopa.testing import tiny_config, write_random_checkpoint

    config = tiny_config(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048)
    weights = write_random_checkpoint(directory, config, seed=1)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0  # confident enough to fill > 1 per step
    save_file(weights, str(directory / "model.safetensors"))
    return directory


def run(args: argparse.Namespace) -> int:
    if args.synthetic:
        with tempfile.TemporaryDirectory(prefix="lopa-bench-model-") as tmp:
            args.model, args.synthetic = str(synthetic_model(Path(tmp))), False
            return run(args)
    raw = {"model": {"path": args.model or ""}, "limits": {"queue_size": max(64, args.concurrency)}}
    config = parse_config(raw)
    kw, prompts = workload(args)
    rows = []
    for workers in [int(w) for w in args.workers.split(",") if w.strip()]:
        rows.append(bench_workers(config, workers, args.requests, args.concurrency, kw, prompts))
        show_row(rows[-1])
    finish(rows, args.json)
    return 0


def workload(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """Request options and prompts: the bundled model gets its held-out task prompts and its own decoding
    defaults (a generic prompt makes its TPF meaningless); the command line's branches / block / attention /
    length settings override. Another model gets the generic prompts, full attention and 64 tokens."""
    cli = {"branches": args.branches, "block_size": args.block_size, "attention": args.attention,
           "max_new_tokens": args.max_new_tokens}
    if args.model:
        kw = {"attention": "full", "max_new_tokens": 64}
        kw.update({k: v for k, v in cli.items() if v is not None})
        return kw, list(PROMPTS)
    from lopa.bundled import tasks
    from lopa.bundled.defaults import model_defaults
    from lopa.serving.model_dir import model_path

    defaults = dataclasses.asdict(model_defaults(model_path("")))
    kw = {k: v.value if isinstance(v, Enum) else v for k, v in defaults.items()}
    kw.update({k: v for k, v in cli.items() if v is not None})
    examples = tasks.held_out(WARMUP + max(args.requests, args.concurrency))
    return kw, [e.prompt for e in examples]
