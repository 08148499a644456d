"""The config file reference: every key of docs/lopa.yaml with its comment, checked against the code.

docs/lopa.yaml is the annotated reference file; the code (lopa.serving.shared.config) is what is read.
A key in one and not the other fails the generation, naming the key, so neither can drift alone.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from tools.docs.markdown import cell

SECTION = re.compile(r"^([a-z0-9_]+):\s*(?:#\s?(.*))?$")
KEY = re.compile(r"^  ([a-z0-9_]+):\s*(.*)$")
COMMENT = re.compile(r"^(\s*)#\s?(.*)$")
LIST_ITEM = re.compile(r"^\s+-\s+(.*)$")
DEFAULT_CLAUSE = re.compile(r"(?:^|;)\s*default:\s*([^;]*)")


class ConfigDocError(ValueError):
    pass


@dataclass
class Key:
    name: str
    example: str
    text: list[str] = field(default_factory=list)


@dataclass
class Section:
    name: str
    text: list[str] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)


def parse(path: Path) -> tuple[list[str], list[Section]]:
    """(the file's header comment, its sections): a key's text is the comment block above it, its
    trailing comment and the deeper-indented comment lines that continue it."""
    header: list[str] = []
    sections: list[Section] = []
    pending: list[str] = []  # a comment block waiting for the key below it
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if match := SECTION.match(line):
            sections.append(Section(match[1], [match[2]] if match[2] else []))
        elif match := KEY.match(line):
            value, _, comment = match[2].partition("#")
            key = Key(match[1], value.strip(), [*pending, *([comment.strip()] if comment else [])])
            sections[-1].keys.append(key)
            pending = []
        elif match := LIST_ITEM.match(line):
            key = sections[-1].keys[-1]
            key.example = f"{key.example} [{match[1]}]" if key.example else f"[{match[1]}]"
        elif match := COMMENT.match(line):
            indent, text = len(match[1]), match[2].strip()
            if not sections:
                header.append(text)
            elif indent > 2 and sections[-1].keys and not pending:
                sections[-1].keys[-1].text.append(text)  # continues the key above
            elif not sections[-1].keys:
                sections[-1].text.append(text)
            else:
                pending.append(text)
        else:
            raise ConfigDocError(f"{path}: cannot read the line {line!r}")
    return header, sections


def code_keys() -> dict[str, dict[str, Any]]:
    """{section: {key: default}} as lopa.serving.shared.config reads the file."""
    from lopa.serving.shared.config import _SECTIONS

    return {name: {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
            for name, cls in _SECTIONS.items()}


def check(sections: list[Section], code: dict[str, dict[str, Any]]) -> None:
    documented = {(s.name, k.name) for s in sections for k in s.keys}
    read = {(s, k) for s, keys in code.items() for k in keys}
    problems = [f"{s}.{k}: read by the code, missing from docs/lopa.yaml"
                for s, k in sorted(read - documented)]
    problems += [f"{s}.{k}: in docs/lopa.yaml, not read by the code" for s, k in sorted(documented - read)]
    if problems:
        raise ConfigDocError("; ".join(problems))


def show_default(value: Any) -> str:
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, tuple):
        return "`[" + ", ".join(value) + "]`"
    if isinstance(value, str):
        return f'`"{value}"`' if not value else f"`{value}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def without_default(text: str, default: str) -> str:
    """The comment less its `default: X` clause when X is just the default shown beside it."""
    match = DEFAULT_CLAUSE.search(text)
    if match and match[1].strip() == default:
        text = text[: match.start()] + text[match.end():]
    return text.strip(" ;")


def render(path: Path) -> str:
    header, sections = parse(path)
    code = code_keys()
    check(sections, code)
    lines = [
        "# Config file reference",
        "",
        "`lopa master` and `lopa worker` read one YAML file (`--config`); the operator renders it into a "
        "ConfigMap and `lopa serve` writes it for its children. This page lists every key of the annotated "
        "reference file `docs/lopa.yaml` (shown whole at the end), with the default the code applies.",
        "",
        *(cell(text) for text in header),
        "",
    ]
    for section in sections:
        lines += [f"## `{section.name}`", ""]
        if section.text:
            lines += [" ".join(section.text), ""]
        lines += ["| key | default | meaning |", "| --- | --- | --- |"]
        for key in section.keys:
            default = show_default(code[section.name][key.name])
            meaning = without_default(" ".join(key.text), default.strip("`"))
            lines.append(f"| `{section.name}.{key.name}` | {cell(default)} | {cell(meaning)} |")
        lines.append("")
    lines += ["## The annotated file", "", "```yaml", path.read_text().rstrip(), "```", ""]
    return "\n".join(lines)
