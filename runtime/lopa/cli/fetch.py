"""`lopa fetch-model URI --into DIR`: a checkpoint from the Hugging Face Hub (or a mirror), as a pod's
init container fetches it before the master and workers load it (lopa.hub)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lopa.hub import FetchError, endpoint, fetch


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fetch-model",
        help="download a checkpoint named hf://org/name[@revision] into a directory",
        description="Download the files of a Hugging Face model revision into a directory, unless it "
        "already holds that revision. HF_ENDPOINT names a mirror, HF_TOKEN authenticates.",
    )
    parser.add_argument("uri", help="hf://org/name[@revision] (default revision: main)")
    parser.add_argument("--into", required=True, type=Path, help="the directory to fill")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(f"lopa fetch-model: {args.uri} from {endpoint()} into {args.into}", flush=True)
    try:
        done = fetch(args.uri, args.into)
    except FetchError as error:
        print(f"lopa fetch-model: error: {error}", file=sys.stderr, flush=True)
        return 1
    what = "downloaded" if done.downloaded else "already held in the cache; no download"
    print(f"lopa fetch-model: {args.uri}: commit {done.commit} {what}", flush=True)
    return 0
