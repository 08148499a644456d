"""`lopa bench step` (one step against the memory floor) and `lopa bench write-checkpoint`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from lopa.cli.generate import add_weights_flag, check_weights
from lopa.cli.preflight import device_problem
from lopa.host.device import resolve_device
from lopa.model.layer_steps import compile_wanted, kernels_wanted
from lopa.model.loader import load_model, parse_dtype
from lopa.model.transformer import DiffusionLM
from lopa.model.weight_formats import FP8, quantize_fp8
from lopa.params import MAX_BRANCHES, InvalidParameter
from lopa.scheduling.calibration import COST_FACTOR
from lopa.serving.shared.config import DTYPES
from lopa.synthetic.checkpoint import (
    PRESETS,
    random_model,
    write_random_lora_adapter,
    write_sharded_checkpoint,
)
from lopa_bench import step
from lopa_bench.rows import check_json, markdown_table, show_row

PAPER_TPF = 10.1  # D2F-Dream-7B with LoPA on GSM8K (the LoPA paper)


def add_parsers(kinds: argparse._SubParsersAction) -> None:
    # long: the flags of `lopa bench step`, one after another
    bench = kinds.add_parser(
        "step",
        help="one decoding step on one device (CUDA graphs vs eager) against the weights' memory floor",
        description="Time verification forwards (rows x window x cache) and whole D2F / LoPA steps; "
        "print tables and write JSON. Ratios are against the floor measured in the same run.",
    )
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory")
    source.add_argument(
        "--preset", choices=sorted(PRESETS), help="random weights of this shape, made on the device"
    )
    bench.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory (merged at load)")
    bench.add_argument("--device", default="auto",
                       help="auto, cuda, cuda:N or cpu; auto: CUDA when present, then an NPU, else the CPU "
                       "(default auto)")
    bench.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights dtype (default bfloat16)")
    add_weights_flag(bench)
    bench.add_argument("--rows", default="1,2,4,8,16", help="forward grid: rows (branches) per forward")
    bench.add_argument("--widths", default="32,64,128", help="forward grid: window tokens per row")
    bench.add_argument("--caches", default="512,2048", help="forward grid: cache lengths")
    bench.add_argument("--ks", default="0,1,3,7,15", help="steps: lookahead branches (0 = the D2F step)")
    bench.add_argument("--step-widths", default="32,64", help="steps: window tokens per row (default 32,64)")
    bench.add_argument("--step-cache", type=int, default=512, help="steps: cache length (default 512)")
    bench.add_argument("--batches", default="1,2,4,8,16",
                       help="batched rounds: requests per round, each with its own cache, against as "
                       "many lone rounds (default 1,2,4,8,16; on CUDA both replay graphs up to 2048 "
                       "tokens a round, eager_ms: both eagerly)")
    bench.add_argument("--batch-k", type=int, default=3,
                       help="batched rounds: lookahead branches per request (default 3; window: the first "
                       "--step-widths, cache: --step-cache)")
    bench.add_argument("--repeat", type=int, default=20, help="timed repetitions per point (median)")
    bench.add_argument("--no-eager", action="store_true", help="skip the eager (no CUDA graph) comparison")
    bench.add_argument("--gemm", action="store_true", help="also time layer 0's matrix products alone")
    bench.add_argument("--gemm-autotune", action="store_true",
                       help="with --gemm: also torch.compile max-autotune of each product (slow: minutes)")
    bench.add_argument("--copy-gb", type=float, default=2.0, help="bytes copied to measure bandwidth (GB)")
    bench.add_argument("--tpf", type=float, default=PAPER_TPF, help=f"TPF for tokens/s (default {PAPER_TPF})")
    bench.add_argument("--profile", default=None, help="directory for a torch.profiler table of the steps")
    bench.add_argument("--json", default=None, help="write every row and the setup here")
    bench.set_defaults(handler=run)

    write = kinds.add_parser(
        "write-checkpoint",
        help="write a random checkpoint of a preset shape (sharded safetensors + index, tokenizer) "
        "and optionally a LoRA adapter, for benchmarks",
    )
    write.add_argument("--preset", choices=sorted(PRESETS), default="dream-7b")
    write.add_argument("--out", required=True, help="checkpoint directory")
    write.add_argument("--adapter-out", default=None, help="also write a D2F-shaped LoRA adapter here")
    write.add_argument("--lora-rank", type=int, default=32, help="LoRA rank (default 32)")
    write.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    write.add_argument("--device", default="auto",
                       help="where the random tensors are drawn (default auto: CUDA when present, faster)")
    write.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")
    write.set_defaults(handler=run_write)


def _ints(text: str, name: str, low: int, high: int | None = None) -> list[int]:
    values = []
    for item in (i.strip() for i in text.split(",")):
        if not item.isdigit() or int(item) < low or (high is not None and int(item) > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise InvalidParameter(name, f"each value must be an integer {bound}, got {item!r}")
        values.append(int(item))
    return values


@dataclass(frozen=True)
class Grids:
    """The checked flag values the bench sweeps."""

    rows: list[int]
    widths: list[int]
    caches: list[int]
    ks: list[int]
    step_widths: list[int]
    batches: list[int]


def run(args: argparse.Namespace) -> int:
    grids = check_args(args)
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    model, mask_id, setup = _load(args, device, dtype)
    max_length = max([*grids.caches, args.step_cache]) + max([*grids.widths, *grids.step_widths]) + 64
    _check_positions(model, max_length, "caches" if max(grids.caches) >= args.step_cache else "step_cache")
    floor = step.memory_floor(model, device, int(args.copy_gb * 1e9))
    # Significant digits, not decimals: a small model on a CPU has a floor of hundredths of a ms and
    # a bandwidth of hundredths of a TB/s, which three decimals would round away.
    setup.update(
        copy_TBps=float(f"{floor.bandwidth_tbps:.4g}"),
        weight_GB=float(f"{floor.weight_bytes / 1e9:.4g}"),
        floor_ms=float(f"{floor.ms():.4g}"),
    )
    print(json.dumps(setup), flush=True)
    eager = device.type == "cuda" and not args.no_eager
    graphs = step.StepBench(model, max_length, mask_id, args.repeat, graphs=device.type == "cuda")
    plain = step.StepBench(model, max_length, mask_id, args.repeat, graphs=False) if eager else None
    out: list[dict] = []

    def rows() -> Iterator[dict]:  # in this order, each shown as soon as it is measured
        yield from _forward_rows(grids, graphs, plain, floor)
        yield from _step_rows(args, grids.ks, grids.step_widths, graphs, plain, floor)
        yield from _round_rows(args, model, mask_id, eager, floor, grids.batches, grids.step_widths[0])
        if args.gemm:
            yield from step.gemm_rows(model, [64, 256], args.repeat, args.gemm_autotune)

    for row in rows():
        show_row(row)
        out.append(row)
    if args.profile:
        width = grids.step_widths[-1]
        cases = [("D2F", 1, width, width // 4), ("LoPA k=3", 4, width, width // 4)]
        print(f"wrote {step.profile_steps(graphs, cases, Path(args.profile))}", file=sys.stderr)
    _print_tables(out, setup, floor)
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": out}, indent=2) + "\n")
    return 0


def check_args(args: argparse.Namespace) -> Grids:
    """Every flag checked before anything loads, each refusal naming its flag."""
    grids = Grids(
        rows=_ints(args.rows, "rows", 1, 64),
        widths=_ints(args.widths, "widths", 2),
        caches=_ints(args.caches, "caches", 0),
        ks=_ints(args.ks, "ks", 0, MAX_BRANCHES),
        step_widths=_ints(args.step_widths, "step_widths", 4),
        batches=_ints(args.batches, "batches", 1, 64),
    )
    if not 0 <= args.batch_k <= MAX_BRANCHES:
        raise InvalidParameter("batch_k", f"must be in [0, {MAX_BRANCHES}], got {args.batch_k}")
    # Flags that would be ignored: --adapter merges into a checkpoint's weights (the setup JSON
    # would still name it), --gemm-autotune tunes the --gemm products.
    if args.adapter and args.preset:
        raise InvalidParameter("adapter", "needs --model: a --preset's random weights take no adapter")
    if args.gemm_autotune and not args.gemm:
        raise InvalidParameter("gemm_autotune", "needs --gemm (it tunes the products --gemm times)")
    if args.gemm and args.weights != "dtype":
        raise InvalidParameter("gemm", "times the dtype weights' products; `lopa bench products` times the "
                               "FP8 kernels beside them")
    if args.step_cache < 0:
        raise InvalidParameter("step_cache", f"must be >= 0, got {args.step_cache}")
    if args.repeat < 2:
        raise InvalidParameter("repeat", f"must be >= 2, got {args.repeat}")
    if not args.copy_gb > 0:
        raise InvalidParameter("copy_gb", f"must be > 0, got {args.copy_gb}")
    if not args.tpf > 0:  # every tok_s_at_tpf column is a multiple of it
        raise InvalidParameter("tpf", f"must be > 0, got {args.tpf}")
    check_json(args.json)
    problem = device_problem(args.device)
    if problem:
        raise InvalidParameter("device", problem)
    args.device = resolve_device(args.device)
    check_weights(args)
    return grids


def _load(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[DiffusionLM, int, dict]:
    """(the model, its mask id, the setup the report starts with)."""
    began = time.perf_counter()
    if args.preset:
        model = random_model(PRESETS[args.preset](), dtype, device)
        if args.weights == FP8:
            quantize_fp8(model)
        mask_id = model.config.mask_token_id or 0
    else:
        loaded = load_model(args.model, args.adapter, dtype, device, weights=args.weights)
        model, mask_id = loaded.model, loaded.special.mask
    step.synchronize(device)
    setup = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "weights": args.weights,
        "layer_steps": layer_steps(device),
        "model": args.model or f"preset {args.preset} (random weights)",
        "family": model.config.family,
        "adapter": args.adapter,
        "load_s": round(time.perf_counter() - began, 1),
        "memory_after_load_GB": (
            round(torch.cuda.memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None
        ),
    }
    return model, mask_id, setup


def _forward_rows(
    grids: Grids, graphs: step.StepBench, plain: step.StepBench | None, floor: step.Floor
) -> Iterator[dict]:
    """Verification forwards over the grid of rows x window x cache."""
    for cache in grids.caches:
        for b in (graphs, plain):
            if b is not None:
                b.fill_cache(cache)
        for r in grids.rows:
            for w in grids.widths:
                ms = graphs.forward_ms(r, w, w // 4)
                row = {"kind": "forward", "rows": r, "window": w, "tokens": r * w, "cache": cache,
                       "ms": round(ms, 3)}
                if plain is not None:
                    row["eager_ms"] = round(plain.forward_ms(r, w, w // 4), 3)
                row["x_floor"] = round(ms / floor.ms(cache), 3)
                yield row


def _step_rows(
    args: argparse.Namespace, ks: list[int], widths: list[int], graphs: step.StepBench,
    plain: step.StepBench | None, floor: step.Floor,
) -> Iterator[dict]:
    """Whole D2F (k = 0) and LoPA steps against the D2F step and the floor."""
    for b in (graphs, plain):
        if b is not None:
            b.fill_cache(args.step_cache)
    for width in widths:
        d2f_ms = graphs.step_ms(1, width, width // 4)
        for k in ks:
            ms = d2f_ms if k == 0 else graphs.step_ms(k + 1, width, width // 4)
            row = {"kind": "step", "k": k, "rows": k + 1, "window": width, "cache": args.step_cache,
                   "tokens": (k + 1) * width, "ms": round(ms, 3)}
            if plain is not None:
                row["eager_ms"] = round(plain.step_ms(k + 1, width, width // 4), 3)
            row["x_floor"] = round(ms / floor.ms(args.step_cache), 3)
            row["x_d2f"] = round(ms / d2f_ms, 3)
            row[f"tok_s_at_tpf_{args.tpf}"] = round(args.tpf * 1e3 / ms, 1)
            yield row


def _print_tables(out: list[dict], setup: dict, floor: step.Floor) -> None:
    """One table per kind of row, then the budget the rounds suggest (added to `setup`)."""
    for kind in ("forward", "step", "round", "gemm"):
        picked = [r for r in out if r["kind"] == kind]
        if picked:
            where = f"floor {floor.ms():.3f} ms at {floor.bandwidth_tbps:.3f} TB/s, {setup['device']}"
            print(f"\n{kind} ({where})")
            print(markdown_table([{k: v for k, v in r.items() if k != "kind"} for r in picked]))
    suggested = step.suggested_step_tokens([r for r in out if r["kind"] == "round"])
    if suggested is not None:
        setup["suggested_max_step_tokens"] = suggested
        print(f"\nsuggested limits.max_step_tokens: {suggested} (the largest round costing at most "
              f"{COST_FACTOR:g}x the smallest)")


def layer_steps(device: torch.device) -> str:
    """How the window models of this run compute the layers' elementwise steps (lopa.model.layer_steps)."""
    if compile_wanted(device):
        return "compiled"
    return "triton" if kernels_wanted(device) else "torch"


def _check_positions(model: DiffusionLM, max_length: int, flag: str) -> None:
    """Before any timing, one line naming the flag: the longest cache + window must fit the model's
    positions (the bundled model's 256 do not hold the default --caches)."""
    positions = model.config.max_position_embeddings
    if max_length > positions:
        reason = f"the longest cache + window + 64 is {max_length} positions, the model holds {positions}"
        raise InvalidParameter(flag, reason)


def _round_rows(
    args: argparse.Namespace, model: DiffusionLM, mask_id: int, eager: bool, floor: step.Floor,
    batches: list[int], width: int,
) -> list[dict]:
    """Batched rounds against as many lone steps: x_lone = the round's time over `requests` lone
    rounds (below 1, batching saves time), and the aggregate tokens/s at the TPF. On CUDA both replay
    a graph of their bucket (lopa.model.cuda_graphs); eager_ms times both eagerly. Their own benches:
    `max(batches)` caches of the step cache."""
    rows_each, n_stage, cache = args.batch_k + 1, width // 4, args.step_cache
    max_length, sequences = cache + width + 64, max(batches)
    graphs = step.StepBench(model, max_length, mask_id, args.repeat, model.device.type == "cuda", sequences)
    plain = step.StepBench(model, max_length, mask_id, args.repeat, False, sequences) if eager else None
    for b in (graphs, plain):
        if b is not None:
            b.fill_cache(cache, sequences)
    lone_ms = graphs.round_ms(1, rows_each, width, n_stage)
    out = []
    for requests in batches:
        ms = lone_ms if requests == 1 else graphs.round_ms(requests, rows_each, width, n_stage)
        row = {"kind": "round", "requests": requests, "k": args.batch_k, "rows": requests * rows_each,
               "window": width, "cache": cache, "tokens": requests * rows_each * width, "ms": round(ms, 3),
               "graphed": _replayed(graphs, requests)}
        if plain is not None:
            row["eager_ms"] = round(plain.round_ms(requests, rows_each, width, n_stage), 3)
        row["x_floor"] = round(ms / floor.ms(requests * cache), 3)  # every request's cache is read
        row["x_lone"] = round(ms / (requests * lone_ms), 3)
        row[f"tok_s_at_tpf_{args.tpf}"] = round(requests * args.tpf * 1e3 / ms, 1)
        out.append(row)
    return out


def run_write(args: argparse.Namespace) -> int:
    if args.shard_gb <= 0:
        raise InvalidParameter("shard_gb", f"must be > 0, got {args.shard_gb}")
    if args.lora_rank < 1:
        raise InvalidParameter("lora_rank", f"must be >= 1, got {args.lora_rank}")
    problem = device_problem(args.device)
    if problem:
        raise InvalidParameter("device", problem)
    args.device = resolve_device(args.device)
    config = PRESETS[args.preset]()
    began = time.perf_counter()
    total = write_sharded_checkpoint(
        args.out, config, parse_dtype(args.dtype), args.device, int(args.shard_gb * 1e9), progress=print
    )
    print(f"checkpoint: {total / 1e9:.2f} GB in {args.out} ({time.perf_counter() - began:.1f} s)", flush=True)
    if args.adapter_out:
        targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        write_random_lora_adapter(args.adapter_out, config, r=args.lora_rank, alpha=float(args.lora_rank),
                                  targets=targets)
        print(f"adapter: rank {args.lora_rank} over {', '.join(targets)} in {args.adapter_out}", flush=True)
    return 0


def _replayed(bench: step.StepBench, requests: int) -> bool:
    """Whether rounds of `requests` requests replayed a CUDA graph (not an eager fallback)."""
    graphs = bench.window.graphs
    if graphs is None:
        return False
    captured = (b for b in graphs.graphs if graphs.captures_bucket(b))  # not LOPA_CUDA_GRAPH_TOKENS' eager
    return graphs.enabled_for(requests) and any(b.requests == requests for b in captured)
