"""`lopa generate`: one request on the local engine, printing the answer and its stats."""

from __future__ import annotations

import argparse
import json
import sys

from lopa.cli.decoding_flags import add_decoding_flags, params_from_args
from lopa.cli.preflight import device_problem, weights_problem
from lopa.decoding.decoder import StepEvent
from lopa.engine import Completion, LocalEngine, bundled_model_dir
from lopa.host.device import resolve_device
from lopa.model.decoding_defaults import model_defaults
from lopa.params import InvalidParameter
from lopa.serving.shared.config import DTYPES, WEIGHTS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="decode one prompt locally (batched branches on one device)",
        description="Decode one prompt with D2F (--branches 0) or LoPA (--branches k > 0).",
    )
    add_model_flags(parser)
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="never fill an end token: the answer is exactly --max-new-tokens long")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--verbose", action="store_true", help="print every step's fills to stderr")
    add_decoding_flags(parser)
    parser.set_defaults(handler=run)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    group.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory, merged at load")
    group.add_argument("--dtype", default="float32", choices=DTYPES,
                       help="weights dtype (default: %(default)s)")
    group.add_argument("--device", default="auto",
                       help="auto, cpu, cuda, cuda:1, npu, npu:1; auto: CUDA when present, then an NPU, else "
                       "the CPU (default: %(default)s)")
    add_weights_flag(group)
    group.add_argument("--max-length", type=int, default=None, help="KV cache length (prompt + output)")


def add_weights_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--weights", default="dtype", choices=WEIGHTS,
                        help="linear weights: dtype (as --dtype) or fp8 (e4m3 with per-channel scales; a "
                        "GPU of compute capability >= 8.9, or the CPU through the reference) "
                        "(default: %(default)s)")


def check_weights(args: argparse.Namespace) -> None:
    """--weights on --device, before the load: InvalidParameter naming the flag."""
    problem = weights_problem(args.weights, args.device)
    if problem:
        raise InvalidParameter("weights", problem)


def stats_of(completion: Completion) -> dict[str, float | int | str]:
    result = completion.result
    return {
        "forwards": result.forwards,
        "tokens": result.tokens,
        "generated_positions": len(result.generated_ids),
        "tpf": round(result.tpf, 4),
        "padded_tpf": round(result.padded_tpf, 4),
        "verified_tokens": result.verified_tokens,
        "tokens_per_s": round(result.tokens_per_s, 2),
        "wall_s": round(result.wall_s, 4),
        "finish_reason": completion.finish_reason,
    }


def run(args: argparse.Namespace) -> int:
    problem = device_problem(args.device)
    if problem:  # before loading: torch would fail deep inside the loader
        raise InvalidParameter("device", problem)
    args.device = resolve_device(args.device)  # auto: the device found, which --weights must suit
    if args.max_length is not None and args.max_length < 1:
        raise InvalidParameter("max_length", f"must be >= 1, got {args.max_length}")
    check_weights(args)
    # The decoding settings before the (slow) load: a bad flag or lopa_defaults.json fails at once.
    params = params_from_args(args, model_defaults(args.model or bundled_model_dir()))
    # One prompt: one KV cache (not limits.max_batch of them), and no branch budget to measure.
    engine = LocalEngine.from_dirs(
        args.model, args.adapter, args.dtype, args.device, args.max_length, max_batch=1, weights=args.weights
    )

    def show_step(event: StepEvent) -> None:
        fills = ", ".join(f"{p}:{engine.decode([t])!r}" for p, t in event.fills)
        line = f"step {event.step}: {event.candidates} candidates, winner {event.winner}: {fills}"
        print(line, file=sys.stderr)

    completion = engine.generate(
        args.prompt, params, stop=args.stop, on_step=show_step if args.verbose else None, chat=args.chat,
        ignore_eos=args.ignore_eos,
    )
    stats = stats_of(completion)
    if args.json:
        print(json.dumps({"text": completion.text, "output_ids": completion.result.output_ids, **stats,
                          "device": args.device}))
        return 0
    print(completion.text)
    print(
        f"-- {stats['tokens']} tokens in {stats['forwards']} forwards on {args.device} ({args.dtype}): "
        f"TPF {stats['tpf']:.2f} "
        f"(padded {stats['padded_tpf']:.2f}), {stats['tokens_per_s']:.1f} tokens/s, "
        f"{stats['wall_s']:.3f} s wall (prefill included; the first request of a fresh process pays "
        f"its warm-up: `lopa bench tpf` measures warm), finish: {stats['finish_reason']}",
        file=sys.stderr,
    )
    return 0
