"""`lopa bench concurrency`: the concurrency sweep on the local engine (one process, no transport).

The same requests one at a time and with 2, 4, 8, 16 in flight on one LocalEngine, side by side in
one run; `lopa bench serving --concurrency ...` runs the same sweep against a served group.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from lopa.cli.generate import add_weights_flag, check_weights
from lopa.cli.preflight import device_problem
from lopa.host.device import resolve_device
from lopa.params import MAX_BRANCHES, InvalidParameter
from lopa.serving.shared.config import DTYPES
from lopa_bench.concurrency import Answer, Send, captures_of, run_level, sweep, sweep_flags
from lopa_bench.rows import check_json, finish, show_row

if TYPE_CHECKING:
    import torch


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "concurrency",
        help="the local engine at 1, 2, 4, 8, 16 concurrent requests: tokens/s, latency, TPF, branches",
        description="Send the same held-out requests with N in flight for each N (continuous batching "
        "on one LocalEngine); print one row per N with its ratios to N=1, and a table.",
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--levels", default="1,2,4,8,16", help="requests in flight, comma-separated")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    parser.add_argument("--branches", type=int, default=3, help="lookahead branches k each request asks")
    parser.add_argument("--max-step-tokens", type=int, default=None,
                        help="branch budget, tokens per forward (default: the device's, cpu a base row "
                        "and one lookahead row per running request, cuda/npu measured at start)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens each request generates (default: the model's default)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the levels this many times interleaved; each row is the median (default 1; "
                        "use 3-5 on a shared or virtual machine, whose speed drifts)")
    parser.add_argument("--device", default="auto",
                        help="auto, cpu, cuda, cuda:1, npu, npu:1; auto: CUDA when present, then an NPU, "
                        "else the CPU (default auto)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="weights dtype (default float32 on any device; pass bfloat16 on a GPU)")
    add_weights_flag(parser)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--profile", default=None,
                        help="directory (cuda only): after the sweep, run its highest level once more "
                        "under torch.profiler and write concurrency_profile.txt (kernels by device time, "
                        "and how busy the device was: below 100%% it waited for the host)")
    parser.set_defaults(handler=run)


def check(args: argparse.Namespace) -> list[int]:
    levels = sweep_flags(args.levels, "levels", args.requests, args.passes)
    if not 0 <= args.branches <= MAX_BRANCHES:
        raise InvalidParameter("branches", f"must be in [0, {MAX_BRANCHES}], got {args.branches}")
    if args.max_step_tokens is not None and args.max_step_tokens < 1:
        raise InvalidParameter("max_step_tokens", f"must be >= 1, got {args.max_step_tokens}")
    if args.threads is not None and args.threads < 1:
        raise InvalidParameter("threads", f"must be >= 1, got {args.threads}")
    check_json(args.json)
    problem = device_problem(args.device)
    if problem:
        raise InvalidParameter("device", problem)
    args.device = resolve_device(args.device)  # the rows and the first line name the device that ran
    check_weights(args)
    if args.profile is not None:
        if not args.device.startswith("cuda"):
            # torch.profiler records CPU ops on its own thread only, and the engine runs on its
            # scheduler thread: a CPU table would be empty (kernels are recorded from any thread).
            raise InvalidParameter("profile", f"needs --device cuda (the kernels' table), got {args.device}")
        if Path(args.profile).exists() and not Path(args.profile).is_dir():
            raise InvalidParameter("profile", f"{args.profile} exists and is not a directory")
    return levels


def run(args: argparse.Namespace) -> int:
    levels = check(args)
    import torch

    from lopa.bundled import tasks
    from lopa.engine import LocalEngine, bundled_model_dir
    from lopa.model.decoding_defaults import model_defaults

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else bundled_model_dir()
    params = model_defaults(model_dir).with_overrides(branches=args.branches)
    if args.max_new_tokens is not None:
        params = params.with_overrides(max_new_tokens=args.max_new_tokens)
    engine = LocalEngine.from_dirs(model_dir, dtype=args.dtype, device=args.device, max_batch=max(levels),
                                   max_step_tokens=args.max_step_tokens, weights=args.weights, warm=params)
    prompts = [e.prompt for e in tasks.held_out(args.requests)]
    budget = engine.scheduler.budget.describe()
    graphs = getattr(engine.window_model, "graphs", None)
    graphs = f", {graphs.describe()}" if graphs is not None else ""
    if engine.loaded.model.steps.compiled:
        graphs += ", layer steps compiled"
    elif engine.loaded.model.steps.kernels:
        graphs += ", layer steps as Triton kernels"
    weights = f", {args.weights} weights" if args.weights != "dtype" else ""
    captured, seconds = engine.window_model.graph_captures()  # by the warm-up (lopa.scheduling.warmup)
    if getattr(engine.window_model, "graphs", None) is not None:
        graphs += f", {captured} graphs captured at start in {seconds:.2f} s"
    print(f"local engine, {model_dir.name} on {args.device} ({args.dtype}{weights}), k={args.branches}, "
          f"budget {budget}{graphs}, {torch.get_num_threads()} threads, "
          f"{args.requests} requests per level, {args.passes} pass(es)", flush=True)

    def send(index: int) -> Answer:
        result = engine.generate(prompts[index % len(prompts)], params).result
        return Answer(result.tokens, result.forwards, result.mean_branches, result.verified_tokens)

    try:
        rows = sweep(send, args.requests, levels, show=show_row, passes=args.passes,
                     captures=captures_of(engine.window_model))
        if args.profile:
            device = engine.window_model.device
            path = write_profile(send, args.requests, max(levels), device, Path(args.profile))
            print(f"profile of {max(levels)} in flight: {path}", flush=True)
    finally:
        engine.close()
    finish(rows, args.json)
    return 0


def write_profile(send: Send, requests: int, level: int, device: torch.device, out: Path) -> Path:
    """The level once more (its graphs captured by the sweep) under torch.profiler, to
    out/concurrency_profile.txt: a summary line, then the kernel table."""
    from lopa.model.window import GRAPHS_ENV, GRAPHS_UNCAPTURED
    from lopa_bench.profiling import profiled

    rows: list[dict] = []
    profile = profiled(lambda: rows.append(run_level(send, requests, level)), device)
    row = rows[0]
    busy = "" if profile.device_busy is None else f", device busy {profile.device_busy:.0%} of the wall time"
    summary = (f"{level} in flight, {requests} requests, after the sweep: {row['wall_s']} s "
               f"({profile.wall_s:.3f} s profiled), {row['tok_s']} tok/s, TPF {row['tpf']}{busy}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "concurrency_profile.txt"
    ops = "Ops by their kernels' device time, per input shapes (CUDA-graph replays' kernels belong to no op: "
    ops += f"{GRAPHS_ENV}={GRAPHS_UNCAPTURED} runs the same rounds uncaptured)"
    path.write_text(f"{summary}\n\n{profile.table}\n\n{ops}\n\n{profile.ops_table}\n")
    print(summary, flush=True)
    return path
