"""`lopa client generate|info --address HOST:PORT`: one request to a LoPA master, or its model info."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from lopa.cli.decoding_flags import HELP, OPTIONAL_TYPES, flag_name
from lopa.params import DecodingParams, InvalidParameter
from lopa.serving.shared.config import API_KEY_ENV

OVERRIDES = ("branches", "block_size", "tau_add", "tau_act", "tau_conf", "conf", "alpha", "beta",
             "branch_score", "branch_policy", "attention", "temperature", "top_p", "top_k", "min_p", "seed")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("client", help="talk to a LoPA master over gRPC")
    actions = parser.add_subparsers(dest="action", required=True)
    gen = actions.add_parser("generate", help="send one request; print the answer and its stats")
    add_connection_flags(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--stream", action="store_true", help="print committed deltas as they arrive")
    gen.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help="generation budget (default: the server's, see `lopa client info`)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="never fill an end token: the answer is exactly --max-new-tokens long")
    gen.add_argument("--pin-branches", action="store_true",
                     help="under load, wait for room for every branch instead of being granted fewer")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default: none)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, finish reason, stats) instead of text")
    group = gen.add_argument_group("decoding overrides (default: the server's, see `lopa client info`)")
    for name in OVERRIDES:
        default = getattr(DecodingParams(), name)
        kind = OPTIONAL_TYPES.get(name) or type(getattr(default, "value", default))
        group.add_argument(flag_name(name), dest=name, type=kind, default=None, help=HELP[name])
    info = actions.add_parser("info", help="print the model info (limits, decoding defaults) and health")
    add_connection_flags(info)
    parser.set_defaults(handler=run)


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051",
                        help="the master's client API, HOST:PORT (default: %(default)s)")
    parser.add_argument("--ca", default=None, help="CA bundle of the server's certificate: use TLS")
    parser.add_argument("--cert", default=None, help="client certificate (mutual TLS; with --key)")
    parser.add_argument("--key", default=None, help="client key (mutual TLS; with --cert)")
    parser.add_argument("--api-key", default=None,
                        help=f"the API key the master asks for (default: the first of {API_KEY_ENV} of the "
                        "environment, else none)")


def run(args: argparse.Namespace) -> int:
    import grpc

    from lopa.serving.client import LopaClient

    check_tls_flags(args)
    api_key = args.api_key
    if api_key is None:  # as the master reads it: keys separated by commas
        api_key = os.environ.get(API_KEY_ENV, "").split(",")[0].strip() or None
    with LopaClient(args.address, ca=args.ca, cert=args.cert, key=args.key, api_key=api_key) as client:
        try:
            return info(client) if args.action == "info" else generate(client, args)
        except grpc.RpcError as error:
            print(f"lopa client: error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1


def check_tls_flags(args: argparse.Namespace) -> None:
    for name in ("ca", "cert", "key"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            raise InvalidParameter(name, f"no such file: {path}")
    if (args.cert is None) != (args.key is None):
        raise InvalidParameter("key" if args.key is None else "cert", "--cert and --key go together")


def info(client: Any) -> int:
    print(client.model_info(), end="")  # protobuf text: one `key: value` line per field
    print("health:", client.health())
    return 0


def generate(client: Any, args: argparse.Namespace) -> int:
    """One request; the answer on stdout (or one JSON object), the stats on stderr."""
    if args.timeout is not None and not args.timeout > 0:
        raise InvalidParameter("timeout", f"must be > 0 (seconds), got {args.timeout}")
    overrides = {name: getattr(args, name) for name in OVERRIDES}
    kwargs = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, chat=args.chat,
                  pin_branches=args.pin_branches, ignore_eos=args.ignore_eos, **overrides)
    if args.stream:
        text, last = "", None
        for chunk in client.stream(args.prompt, timeout=args.timeout, **kwargs):
            text += chunk.text
            if not args.json:
                print(chunk.text, end="", flush=True)
            last = chunk
        stats, reason = last.stats, last.finish_reason
        if not args.json:
            print()
    else:
        reply = client.generate(args.prompt, timeout=args.timeout, **kwargs)
        text, stats, reason = reply.text, reply.stats, reply.finish_reason
        if not args.json:
            print(text)
    if args.json:
        print(json.dumps({"text": text, "finish_reason": reason, "forwards": stats.forwards,
                          "tokens": stats.tokens, "tpf": round(stats.tpf, 4),
                          "tokens_per_s": round(stats.tokens_per_s, 2), "wall_s": round(stats.wall_s, 4),
                          "ttft_s": round(stats.ttft_s, 4),
                          "mean_branches": round(stats.mean_branches, 3),
                          "verified_tokens": stats.verified_tokens}))
    else:
        print(f"-- {stats.tokens} tokens in {stats.forwards} forwards: TPF {stats.tpf:.2f}, "
              f"{stats.tokens_per_s:.1f} tokens/s, {stats.wall_s:.3f} s wall, ttft {stats.ttft_s:.3f} s, "
              f"{stats.mean_branches:.2f} lookahead branches/round, "
              f"{stats.verified_tokens / max(1, stats.tokens):.1f} verified tokens/token, finish: {reason}",
              file=sys.stderr)
    return 0
