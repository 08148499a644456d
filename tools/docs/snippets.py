"""The runnable snippets of a docs page, marked in its Markdown so a test can run them.

A marker is an HTML comment on the line before a fenced block (invisible on the site):

    <!-- snippet:server -->        the command that starts the server the others talk to
    <!-- snippet:run NAME -->      a command to run
    <!-- snippet:output NAME -->   what that command prints (stdout, then stderr); `...` stands for
                                   anything (doctest's ELLIPSIS), e.g. timings
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MARKED_BLOCK = re.compile(
    r"^<!-- snippet:(?P<kind>server|run|output)(?: (?P<name>[\w-]+))? -->\n+"
    r"^(?P<fence>```+)[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
MARKER = re.compile(r"<!-- snippet:")


class SnippetError(ValueError):
    pass


@dataclass
class Snippets:
    server: str = ""
    runs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)


def parse(path: Path) -> Snippets:
    """The page's marked snippets; SnippetError naming the page and the marker when a marker has no
    block, a name repeats, or a command has no output (or an output no command)."""
    text = path.read_text()
    found = Snippets()
    blocks = list(MARKED_BLOCK.finditer(text))
    if len(blocks) != len(MARKER.findall(text)):
        raise SnippetError(f"{path}: a snippet marker is not followed by a fenced block")
    for block in blocks:
        kind, name, body = block["kind"], block["name"], block["body"]
        if kind == "server":
            if found.server:
                raise SnippetError(f"{path}: more than one snippet:server")
            found.server = body.strip()
            continue
        if not name:
            raise SnippetError(f"{path}: snippet:{kind} needs a name")
        table = found.runs if kind == "run" else found.outputs
        if name in table:
            raise SnippetError(f"{path}: snippet:{kind} {name} appears twice")
        table[name] = body
    if set(found.runs) != set(found.outputs):
        raise SnippetError(f"{path}: runs {sorted(found.runs)} and outputs {sorted(found.outputs)} differ")
    return found
