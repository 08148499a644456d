"""MkDocs hooks of the docs site (mkdocs.yml `hooks:`).

Pages that live beside the code they describe (the benchmark results, the chart's values, the
contributor guides) join the site from where they are, so each exists once. Links inside them are
relative to their own folder, so each comes with the folder it links into. The pages of docs/ link
them where they live (a link that works on a repository page as in the site), and the build
rewrites those links to the pages' places in the site.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

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


# A relative Markdown link: its target and anchor (no URL scheme, no bare anchor).
_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#)([^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """A page of docs/ links a file as the repository has it, so that the link works on a repository
    page too; a file the site brings in from elsewhere (EXTERNAL) is linked where it lives, and
    rewritten here to its place in the site. A link that resolves only in the site fails the build."""
    repo = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    if docs not in Path(page.file.abs_src_path or "").resolve().parents:
        return markdown  # a page brought in: its links are relative to where it lives already
    # Where the page lives in the repository (docs_dir may be a copy of docs/, as the tests build).
    source = repo / "docs" / page.file.src_uri
    site_of = {(repo / path).resolve(): site for site, path in external_files(repo).items()}
    here = posixpath.dirname(page.file.src_uri)

    def link(match: re.Match[str]) -> str:
        target, anchor = match[1], match[2] or ""
        resolved = (source.parent / target).resolve()
        if resolved in site_of:
            return f"]({posixpath.relpath(site_of[resolved], here or '.')}{anchor})"
        in_site = posixpath.normpath(posixpath.join(here, target))
        if not resolved.exists() and in_site in EXTERNAL:
            real = EXTERNAL[in_site]
            where = os.path.relpath(repo / real, source.parent)
            raise ValueError(f"docs/{page.file.src_uri}: the link {target!r} resolves only in the built "
                             f"site; link {real} where it lives ({where})")
        return match[0]

    return _LINK.sub(link, markdown)
