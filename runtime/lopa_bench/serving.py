"""`lopa bench serving`: step time split (forward / coordination / commit) and a concurrency sweep.

For each worker count it starts a LocalCluster (the `lopa serve` launcher), runs the concurrency
sweep of lopa_bench.concurrency against it (the same requests 1, 2, 4, 8, 16 in flight, batched by
the master), and reads the step split of the one-at-a-time level from the master's Prometheus
histograms (so the numbers are the ones production exports).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from lopa.params import MAX_BRANCHES, InvalidParameter
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster, loopback_config
from lopa.serving.ports import free_ports
from lopa.serving.shared.config import Limits, MasterConfig, ServingConfig, parse_config, with_model_defaults
from lopa.serving.shared.model_dir import model_path
from lopa_bench.concurrency import Answer, combine, positive_ints, run_level, sweep_flags, with_ratios
from lopa_bench.rows import check_json, finish, show_row

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
    config: ServingConfig, workers: int, requests: int, levels: Sequence[int], kw: dict,
    prompts: Sequence[str] = PROMPTS, passes: int = 1,
) -> tuple[dict, list[dict]]:
    """One worker count: its step split row (of the first level's first pass) and its sweep rows
    (`passes` interleaved passes combined, see lopa_bench.concurrency). prompts[:WARMUP] warm up,
    the measured requests cycle through the rest."""
    # long: one worker count's run: start, warm up, sweep, stop, in the order they run
    warmup, measured = list(prompts[:WARMUP]), list(prompts[WARMUP:]) or list(prompts)
    metrics_port = free_ports(1)[0]
    config = dataclasses.replace(config, master=MasterConfig(metrics_port=metrics_port))
    config = loopback_config(config, workers)
    decoded: list[tuple[int, float, int]] = []  # (tokens, master's decode wall s, forwards) per request

    def send(index: int) -> Answer:
        stats = client.generate(measured[index % len(measured)], timeout=600, **kw).stats
        decoded.append((stats.tokens, stats.wall_s, stats.forwards))
        return Answer(stats.tokens, stats.forwards, stats.mean_branches, stats.verified_tokens)

    runs: list[list[dict]] = []
    with tempfile.TemporaryDirectory(prefix="lopa-bench-") as tmp:
        cluster = LocalCluster(config, Path(tmp), log_dir=Path(tmp))
        began = time.perf_counter()
        print(f"starting a master and {workers} worker(s) ...", flush=True)  # ~10 s: the model loads
        cluster.start()
        print(f"group of {workers} formed in {time.perf_counter() - began:.1f} s; warming up", flush=True)
        try:
            with LopaClient(cluster.address) as client:
                for prompt in warmup:
                    client.generate(prompt, timeout=600, **kw)
                for number in range(passes):
                    rows = []
                    for level in levels:
                        before, decoded[:] = scrape(metrics_port), []
                        rows.append({"workers": workers, **run_level(send, requests, level)})
                        with_ratios(rows)
                        show_row({"pass": number + 1, **rows[-1]} if passes > 1 else rows[-1])
                        if number == 0 and len(rows) == 1:
                            split, lone = step_split(before, scrape(metrics_port)), list(decoded)
                    runs.append(rows)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            # The group refused the bench's request options; its details name the request field
            # ("decoding.branches: ...", see InvalidParameter): one line naming the flag, no traceback.
            field, _, reason = error.details().partition(": ")
            raise InvalidParameter(field.removeprefix("decoding."), reason) from None
        finally:
            cluster.stop()
    tokens, wall, steps = (sum(column) for column in zip(*lone, strict=True))
    step_ms = 1000 * wall / steps if steps else 0.0
    overhead = split["coordination"] + split["commit"]
    return {
        "workers": workers,
        "concurrency": levels[0],
        "step_ms": round(step_ms, 3),
        **{f"{p}_ms": round(v, 3) for p, v in split.items()},
        "overhead_ms": round(overhead, 3),
        "overhead_pct": round(100 * overhead / step_ms, 1) if step_ms else 0.0,
        "tpf": round(tokens / steps, 3) if steps else 0.0,
    }, combine(runs)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "serving",
        help="branch-parallel serving on loopback: step time split and tokens/s per worker count",
        description="Start master + N workers for each N; report forward / coordination / commit per step "
        "and tokens/s for one request and for concurrent ones.",
    )
    source = parser.add_mutually_exclusive_group()  # --synthetic replaced --model's checkpoint, silently
    source.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    source.add_argument(
        "--synthetic", action="store_true",
        help="use a random 4-layer model (hidden 256, vocab 2048) instead: the transport, not the model",
    )
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--concurrency", default="1,2,4,8,16",
                        help="requests in flight, comma-separated; the step split is of the first level")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the levels this many times interleaved; each row is the median (default 1; "
                        "use 3-5 on a shared or virtual machine, whose speed drifts)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="limits.max_batch of the served group (default: the largest level)")
    parser.add_argument("--max-step-tokens", type=int, default=None,
                        help="limits.max_step_tokens, the branch budget (default: the device's)")
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--attention", default=None, choices=["full", "block_causal"],
                        help="default: the bundled model's default, else full")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: the bundled model's default, else 64")
    parser.add_argument("--block-size", type=int, default=None, help="default: the model's (server) default")
    parser.add_argument("--json", default=None,
                        help="also write {step_split: rows, concurrency: rows} to this file")
    parser.set_defaults(handler=run)


def synthetic_model(directory: Path) -> Path:
    """A random Dream checkpoint big enough that a step is mostly forward, small enough for CPU."""
    from safetensors.torch import save_file

    from lopa.synthetic import tiny_config, write_random_checkpoint

    config = tiny_config(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048)
    weights = write_random_checkpoint(directory, config, seed=1)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0  # confident enough to fill > 1 per step
    save_file(weights, str(directory / "model.safetensors"))
    return directory


def run(args: argparse.Namespace) -> int:
    levels = sweep_flags(args.concurrency, "concurrency", args.requests, args.passes)
    # Before any group starts: a bad count would otherwise fail after the earlier counts ran.
    worker_counts = positive_ints(args.workers, "workers", "worker count")
    if not 0 <= args.branches <= MAX_BRANCHES:
        raise InvalidParameter("branches", f"must be in [0, {MAX_BRANCHES}], got {args.branches}")
    if args.max_batch is not None and args.max_batch < 1:  # 0 would fall back to the default below
        raise InvalidParameter("max_batch", f"must be >= 1, got {args.max_batch}")
    check_json(args.json)
    if args.synthetic:
        with tempfile.TemporaryDirectory(prefix="lopa-bench-model-") as tmp:
            args.model, args.synthetic = str(synthetic_model(Path(tmp))), False
            return run(args)
    limits = {"queue_size": max(64, *levels), "max_batch": args.max_batch or max(levels),
              # The group is the bench's own: it serves the k asked, above the default server limit too.
              "max_branches": max(Limits.max_branches, args.branches)}
    if args.max_step_tokens is not None:
        limits["max_step_tokens"] = args.max_step_tokens
    config = parse_config({"model": {"path": args.model or ""}, "limits": limits})
    # The served defaults are the model's own (as `lopa serve` does): a config without decoding keys
    # would otherwise default to the paper's 256 new tokens, more than the bundled model holds.
    config = with_model_defaults(config, model_path(config.model.path))
    kw, prompts = workload(args, args.requests)
    splits, sweeps = [], []
    for workers in worker_counts:
        split, rows = bench_workers(config, workers, args.requests, levels, kw, prompts, args.passes)
        splits.append(split)
        sweeps.extend(rows)
    print("step split (the first level):")
    finish(splits, None)
    print("concurrency sweep:")
    finish(sweeps, None)
    if args.json:
        Path(args.json).write_text(json.dumps({"step_split": splits, "concurrency": sweeps}, indent=2) + "\n")
    return 0


def workload(args: argparse.Namespace, requests: int) -> tuple[dict, list[str]]:
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
    from lopa.model.decoding_defaults import model_defaults

    defaults = dataclasses.asdict(model_defaults(model_path("")))
    kw = {k: v.value if isinstance(v, Enum) else v for k, v in defaults.items()}
    kw.update({k: v for k, v in cli.items() if v is not None})
    examples = tasks.held_out(WARMUP + requests)
    return kw, [e.prompt for e in examples]
