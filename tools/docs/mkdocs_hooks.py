"""MkDocs hooks of the docs site (mkdocs.yml `hooks:`).

Pages that live beside the code they describe (the benchmark results, the chart's values, the
contributor guides) join the site from where they are, so each exists once. Links inside them are
relative to their own folder, so each comes with the folder it links into.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# site path: repository path (a folder maps every file below it)
EXTERNAL = {
    "benchmarks.md": "runtime/BENCHMARKS.md",
    "figures": "runtime/figures",  # the images BENCHMARKS.md shows
    "guides/benchmark-clients.md": "tools/bench-clients/README.md",
    "reference/helm-chart.md": "charts/lopa-operator/README.md",
    "reference/manifests.md": "manifests/README.md",
    "development/contributing.md": "CONTRIBUTING.md",
    "development/tests.md": "tests/README.md",
}


def external_files(repo: Path) -> dict[str, Path]:
    """{site path: source file} of every file EXTERNAL brings in."""
    out = {}
    for site_path, repo_path in EXTERNAL.items():
        source = repo / repo_path
        if source.is_dir():
            for path in sorted(p for p in source.rglob("*") if p.is_file()):
                out[f"{site_path}/{path.relative_to(source).as_posix()}"] = path
        else:
            out[site_path] = source
    return out


def on_files(files: Files, config: MkDocsConfig) -> Files:
    repo = Path(config.config_file_path).resolve().parent
    for site_path, source in external_files(repo).items():
        if files.get_file_from_path(site_path) is not None:
            raise ValueError(f"docs/{site_path} exists and would hide {source.relative_to(repo)}: remove one")
        files.append(File.generated(config, site_path, abs_src_path=str(source)))
    return files
