"""`lopa bench products`: a decoding step's matrix products alone, bf16 against FP8 kernels."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lopa.cli.preflight import device_problem
from lopa.kernels.fp8_products import TABLE_ENV, describe
from lopa.model.config import ModelConfig
from lopa.model.loader import parse_dtype
from lopa.params import InvalidParameter
from lopa.serving.shared.config import DTYPES
from lopa.synthetic.checkpoint import PRESETS
from lopa_bench import products
from lopa_bench.cli.step import _ints
from lopa_bench.rows import check_json, markdown_table, show_row
from lopa_bench.step import synchronize


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "products",
        help="the matrix products of one step alone: the dtype's against the FP8 kernels, per shape",
        description="Time every product shape of the model (random weights of its shapes) at each token "
        "count with each kernel, back to back; sum a step's; print tables and the choice table the "
        f"measurements suggest (write it with --json; {TABLE_ENV}=that file makes a process use it).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory (only its config.json is read: the shapes)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="the shapes of this preset")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="activations and dtype weights")
    parser.add_argument("--tokens", default="32,64,128,256",
                        help="rows of each product (default 32,64,128,256)")
    parser.add_argument("--kernels", default=",".join(products.KERNELS[:3]),
                        help=f"which of {', '.join(products.KERNELS)} to time (default "
                        "dtype,triton,scaled_mm; triton needs CUDA)")
    parser.add_argument("--repeat", type=int, default=20, help="timed repetitions per point (median)")
    parser.add_argument("--json", default=None, help="write the rows, the setup and the suggested table here")
    parser.set_defaults(handler=run)


def _kernels(text: str) -> list[str]:
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [k for k in chosen if k not in products.KERNELS]
    if not chosen or unknown:
        raise InvalidParameter("kernels", f"each must be one of {', '.join(products.KERNELS)}, got {text!r}")
    if products.DTYPE not in chosen:
        raise InvalidParameter("kernels", "must include dtype: every ratio is to it")
    return list(dict.fromkeys(chosen))


def run(args: argparse.Namespace) -> int:
    tokens = _ints(args.tokens, "tokens", 1)
    kernels = _kernels(args.kernels)
    if args.repeat < 2:
        raise InvalidParameter("repeat", f"must be >= 2, got {args.repeat}")
    check_json(args.json)
    problem = device_problem(args.device)
    if problem:
        raise InvalidParameter("device", problem)
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    config = PRESETS[args.preset]() if args.preset else ModelConfig.from_dir(args.model)
    shapes = products.step_shapes(config)
    setup = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "model": args.model or f"preset {args.preset}",
        "layers": config.num_hidden_layers,
        "kernels": kernels,
    }
    print(json.dumps(setup), flush=True)
    measured = products.measure(shapes, tokens, kernels, dtype, device, args.repeat)
    synchronize(device)
    for row in measured:
        show_row(row)
    steps = products.step_rows(measured, shapes, kernels)
    for row in steps:
        show_row(row)
    table = describe(tuple(products.suggested_table(measured, shapes, kernels)))
    for kind, rows in (("product", measured), ("step", steps)):
        where = f"{setup['device']}, {setup['dtype']}"
        print(f"\n{kind} ({where}; ms, and x_dtype: the ratio to the dtype product)")
        print(markdown_table([{k: v for k, v in r.items() if k != "kind"} for r in rows]))
    print(f"\nsuggested choices ({TABLE_ENV}=<the --json file> uses them):")
    print(markdown_table(table))
    if args.json:
        report = {"setup": setup, "rows": [*measured, *steps], "choices": table}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
