"""Generate the reference pages of the docs site from their sources, or check they are current.

    python -m tools.docs.gen_reference            # rewrite docs/reference/{cli,config,crd,grpc,metrics}.md
    python -m tools.docs.gen_reference --check    # exit 1, naming the stale pages, when they differ

Run from the repository root with lopa and lopa-operator importable (the venv, or PYTHONPATH).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from tools.docs import ref_cli, ref_config, ref_crd, ref_grpc, ref_metrics
from tools.docs.markdown import GENERATED_NOTE

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path("docs/reference")
CONFIG = REPO / "docs" / "lopa.yaml"
CRD = Path("manifests/crds/lopadeployments.lopa.dev.yaml")
PROTOS = REPO / "protos"


def pages() -> dict[str, tuple[str, Callable[[], str]]]:
    """{file name: (its sources, as the page names them; what renders it)}."""
    return {
        "cli.md": ("the commands' argparse parsers (`runtime/lopa/cli/`, "
                   "`operator/lopa_operator/__main__.py`)", ref_cli.render),
        "config.md": ("`docs/lopa.yaml` and `runtime/lopa/serving/shared/config.py`",
                      lambda: ref_config.render(CONFIG)),
        "crd.md": (f"`{CRD.as_posix()}`", lambda: ref_crd.render(REPO, CRD, ref_config.code_keys())),
        "grpc.md": ("`protos/lopa/v1/*.proto`", lambda: ref_grpc.render(PROTOS)),
        "metrics.md": ("`runtime/lopa/serving/shared/metrics.py`, `vllm_metrics.py` and "
                       "`operator/lopa_operator/metrics.py`", ref_metrics.render),
    }


def generate() -> dict[str, str]:
    """{file name: page text} of every generated page."""
    out = {}
    for name, (sources, render) in pages().items():
        body = render()
        title, _, rest = body.partition("\n")
        out[name] = f"{title}\n\n{GENERATED_NOTE.format(source=sources)}\n{rest.rstrip()}\n"
    return out


def stale(directory: Path) -> list[str]:
    """The generated pages that are missing from directory or differ from what the sources give."""
    return [name for name, text in generate().items()
            if not (directory / name).is_file() or (directory / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs.gen_reference",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / REFERENCE, help="directory (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        names = stale(args.out)
        if names:
            print(f"stale generated pages in {args.out}: {', '.join(names)} "
                  "(run `python -m tools.docs.gen_reference`)", file=sys.stderr)
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (args.out / name).write_text(text)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
