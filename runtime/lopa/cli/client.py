"""`lopa client generate --address HOST:PORT [--stream]`: one request to a LoPA master."""

from __future__ import annotations

import argparse
import json
import sys

from lopa.cli.decoding_flags import HELP, flag_name
from lopa.params import DecodingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("client", help="talk to a LoPA master over gRPC")
    actions = parser.add_subparsers(dest="action", required=True)
    gen = actions.add_parser("generate", help="send one request; print the answer and its stats")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true")
    gen.add_argument("--stream", action="store_true", help="print committed deltas as they arrive")
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--json", action="store_true")
    gen.add_argument("--ca", default=None, help="CA bundle: use TLS")
    gen.add_argument("--cert", default=None, help="client certificate (mutual TLS)")
    gen.add_argument("--key", default=None, help="client key (mutual TLS)")
    group = gen.add_argument_group("decoding overrides (default: the server's)")
    for name in ("branches", "block_size", "tau_add", "tau_act", "tau_conf", "conf", "alpha", "beta",
                 "attention", "temperature", "top_p", "top_k", "seed"):
        kind = type(getattr(getattr(DecodingParams(), name), "value", getattr(DecodingParams(), name)))
        group.add_argument(flag_name(name), dest=name, type=kind, default=None, help=HELP[name])
    info = actions.add_parser("info", help="print the model info and health")
    info.add_argument("--address", default="127.0.0.1:50051")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from lopa.serving.client import LopaClient

    if args.action == "info":
        with LopaClient(args.address) as client:
            print(client.model_info())
            print("health:", client.health())
        return 0
    overrides = {name: getattr(args, name) for name in ("branches", "block_size", "tau_add", "tau_act",
                 "tau_conf", "conf", "alpha", "beta", "attention", "temperature", "top_p", "top_k", "seed")}
    with LopaClient(args.address, ca=args.ca, cert=args.cert, key=args.key) as client:
        kwargs = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, chat=args.chat, **overrides)
        try:
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
        except grpc.RpcError as error:
            print(f"lopa client: error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"text": text, "finish_reason": reason, "forwards": stats.forwards,
                          "tokens": stats.tokens, "tpf": round(stats.tpf, 4),
                          "tokens_per_s": round(stats.tokens_per_s, 2), "wall_s": round(stats.wall_s, 4),
                          "ttft_s": round(stats.ttft_s, 4)}))
    else:
        print(f"-- {stats.tokens} tokens in {stats.forwards} forwards: TPF {stats.tpf:.2f}, "
              f"{stats.tokens_per_s:.1f} tokens/s, {stats.wall_s:.3f} s wall, ttft {stats.ttft_s:.3f} s, "
              f"finish: {reason}", file=sys.stderr)
    return 0
