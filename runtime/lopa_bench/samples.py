"""`lopa bench samples`: one request for n samples of a prompt against n requests of it, side by side.

A served group (master + workers on loopback, the OpenAI HTTP API) of the bundled model. Per pass,
in turn: one /v1/completions body with `n` and a seed s, then n bodies at once with n = 1 and the
seeds s .. s + n - 1 (what the n samples are, see admission.samples). Both decode the same answers
(checked); the table gives each variant's wall time and tokens/s, and their ratio within the pass.
Passes interleave the variants (a virtual machine's speed drifts): each row is the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lopa.params import InvalidParameter
from lopa_bench.rows import check_json, finish

PROMPT_INDEX = 0  # the first held-out prompt of the bundled task suite
MAX_PROMPT_TOKENS = 256 - 32  # the bundled model's context less its answers' (max_new_tokens)


def _prompt(tokens: int) -> str | list[int]:
    """The first held-out prompt (tokens 0), else `tokens` ids of the held-out prompts in a row."""
    from lopa.bundled import tasks

    if not tokens:
        return tasks.held_out(PROMPT_INDEX + 1)[PROMPT_INDEX].prompt
    return held_out_ids(tokens)[:tokens]


def held_out_ids(tokens: int) -> list[int]:
    """At least `tokens` ids: the bundled model's held-out prompts, tokenized one after another
    (InvalidParameter naming --prompt-tokens when they hold fewer)."""
    from lopa.bundled import bundled_model_dir, tasks
    from lopa.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(bundled_model_dir())
    ids: list[int] = []
    for example in tasks.held_out(200):
        ids += tokenizer.encode(example.prompt, add_special_tokens=False)
        if len(ids) >= tokens:
            return ids
    raise InvalidParameter("prompt_tokens", f"the held-out prompts hold {len(ids)} tokens, not {tokens}")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "samples",
        help="n samples of one prompt in one request against n separate requests (HTTP, served group)",
        description="Serve the bundled model on loopback; time one request with n samples against n "
        "requests of one sample each, with the same seeds; print a table, write JSON.",
    )
    parser.add_argument("--n", type=int, default=8, help="samples (default %(default)s)")
    parser.add_argument("--passes", type=int, default=3, help="interleaved passes, median kept (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="branch workers (default %(default)s)")
    parser.add_argument("--branches", type=int, default=3, help="lookahead branches (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="a prompt of this many tokens, the held-out prompts' tokens one after another "
                        "(default: the first held-out prompt as it is, 29 tokens): the longer the prompt, "
                        "the larger the share of the first forward, which the samples share")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="answers of max_new_tokens each (no end token filled; a long prompt of held-out "
                        "prompts in a row is otherwise answered in a few tokens)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in ("n", "passes", "workers"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, f"must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.prompt_tokens <= MAX_PROMPT_TOKENS:
        raise InvalidParameter("prompt_tokens", f"must be in [0, {MAX_PROMPT_TOKENS}] (the bundled model's "
                                                f"context is 256 tokens), got {args.prompt_tokens}")
    check_json(args.json)
    from lopa.serving.launcher import LocalCluster, loopback_config
    from lopa.serving.ports import free_ports
    from lopa.serving.shared.config import parse_config, with_model_defaults
    from lopa.serving.shared.model_dir import model_path

    (http,) = free_ports(1)
    raw = {"limits": {"queue_size": max(64, args.n), "max_batch": max(8, args.n)},
           "master": {"http_port": http}}
    config = loopback_config(with_model_defaults(parse_config(raw), model_path("")), workers=args.workers)
    body = {"model": "lopa-bundled", "prompt": _prompt(args.prompt_tokens),
            "temperature": args.temperature, "branches": args.branches, "pin_branches": True,
            "ignore_eos": args.ignore_eos}
    with tempfile.TemporaryDirectory(prefix="lopa-bench-samples-") as tmp:
        cluster = LocalCluster(config, Path(tmp))
        cluster.start(timeout=300)
        try:
            url = f"http://127.0.0.1:{http}/v1/completions"
            _post(url, {**body, "seed": 1})  # warm-up
            passes = [_pass(url, body, args.n, seed=1000 * (p + 1)) for p in range(args.passes)]
        finally:
            cluster.stop()
    rows = _rows(passes, args)
    finish(rows, args.json)
    return 0


def _pass(url: str, body: dict, n: int, seed: int) -> dict[str, Any]:
    began = time.perf_counter()
    together = _post(url, {**body, "n": n, "seed": seed})
    together_s = time.perf_counter() - began
    with ThreadPoolExecutor(n) as pool:
        began = time.perf_counter()
        alone = list(pool.map(lambda j: _post(url, {**body, "seed": seed + j}), range(n)))
        alone_s = time.perf_counter() - began
    texts = [choice["text"] for choice in together["choices"]]
    return {"together_s": together_s, "alone_s": alone_s, "tokens": together["usage"]["completion_tokens"],
            "same": texts == [done["choices"][0]["text"] for done in alone]}


def _rows(passes: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    tokens = passes[0]["tokens"]
    together = statistics.median(p["together_s"] for p in passes)
    alone = statistics.median(p["alone_s"] for p in passes)
    ratio = statistics.median(p["alone_s"] / p["together_s"] for p in passes)
    same = all(p["same"] for p in passes)
    common = {"n": args.n, "workers": args.workers, "branches": args.branches, "passes": args.passes,
              "prompt_tokens": args.prompt_tokens or None, "ignore_eos": args.ignore_eos,
              "same_answers": same}
    return [
        {"variant": f"one request, n={args.n}", **common, "seconds": round(together, 3),
         "tokens_per_s": round(tokens / together, 1), "x_separate": round(ratio, 3)},
        {"variant": f"{args.n} requests, n=1", **common, "seconds": round(alone, 3),
         "tokens_per_s": round(tokens / alone, 1), "x_separate": 1.0},
    ]


def _post(url: str, body: dict) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)
