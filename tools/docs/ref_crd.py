"""The LoPADeployment reference: every field of the CRD's openAPIV3Schema, its rules and columns."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tools.docs.markdown import cell

CONSTRAINTS = ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "pattern")


def render(repo: Path, crd_path: Path, config_keys: dict[str, dict[str, Any]]) -> str:
    """The page of the CRD at repo / crd_path (a path relative to the repository, as the page names it)."""
    crd = yaml.safe_load((repo / crd_path).read_text())
    names = crd["spec"]["names"]
    lines = [
        f"# {names['kind']} reference",
        "",
        f"The fields of `{names['kind']}` (`{crd['spec']['group']}`, short name "
        f"`{', '.join(names.get('shortNames', []))}`), read from the CRD's schema "
        f"(`{crd_path.as_posix()}`). A field's defaults, ranges and rules are the API server's: a spec "
        "that breaks one is refused at `kubectl apply`, naming the field.",
        "",
    ]
    for version in crd["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        lines += [f"## `{crd['spec']['group']}/{version['name']}`", ""]
        lines += printer_columns(version.get("additionalPrinterColumns", []))
        for top in ("spec", "status"):
            if top in schema.get("properties", {}):
                lines += [f"### `{top}`", "", "| field | type | default | constraints | meaning |",
                          "| --- | --- | --- | --- | --- |"]
                rows = fields(schema["properties"][top], top)
                lines += [row(path, node, config_keys) for path, node in rows]
                lines.append("")
        lines += rules(schema)
    return "\n".join(lines)


def printer_columns(columns: list[dict[str, Any]]) -> list[str]:
    if not columns:
        return []
    out = ["### `kubectl get` columns", "", "| column | from | meaning |", "| --- | --- | --- |"]
    for column in columns:
        wide = " (`-o wide`)" if column.get("priority", 0) > 0 else ""
        source = f"`{column['jsonPath']}`"
        out.append(f"| {column['name']}{wide} | {cell(source)} | {cell(column.get('description', ''))} |")
    return [*out, ""]


def fields(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, schema node) below node, depth first in the schema's order; `[]` marks a list's
    items and `{}` a map's values."""
    for name, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{name}"
        yield child_path, child
        yield from fields(child, child_path)
        items = child.get("items")
        if isinstance(items, dict) and items.get("properties"):
            yield from fields(items, f"{child_path}[]")
        values = child.get("additionalProperties")
        if isinstance(values, dict) and values.get("properties"):
            yield from fields(values, f"{child_path}{{}}")


def type_of(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {type_of(node.get('items') or {})}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {type_of(node['additionalProperties'])}"
    if kind == "object" and node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (any fields)"
    return f"{kind} ({node['format']})" if "format" in node else kind


def constraints(node: dict[str, Any]) -> str:
    out = []
    if "enum" in node:
        out.append(" | ".join(f"`{value}`" for value in node["enum"]))
    for key in CONSTRAINTS:
        if key in node:
            exclusive = node.get(f"exclusive{key[0].upper()}{key[1:]}") is True
            out.append(f"{key}{' (exclusive)' if exclusive else ''}: `{node[key]}`")
    if node.get("required"):
        out.append("requires " + ", ".join(f"`{name}`" for name in node["required"]))
    return "; ".join(out)


def config_key(path: str, config_keys: dict[str, dict[str, Any]]) -> str:
    """The runtime config key a spec.decoding / spec.limits field becomes, when there is one."""
    parts = path.split(".")
    if len(parts) != 3 or parts[0] != "spec" or parts[1] not in config_keys:
        return ""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", parts[2]).lower()
    if snake not in config_keys[parts[1]]:
        return ""
    return f"config key [`{parts[1]}.{snake}`](config.md#{parts[1]})"


def row(path: str, node: dict[str, Any], config_keys: dict[str, dict[str, Any]]) -> str:
    default = ""
    if "default" in node:  # one flow-style YAML value, without the end-of-document marker of a scalar
        value = yaml.safe_dump(node["default"], default_flow_style=True).replace("\n...", "").strip()
        default = f"`{value}`"
    meaning = " ".join((node.get("description") or "").split())
    key = config_key(path, config_keys)
    meaning = f"{meaning} ({key})" if meaning and key else meaning or key
    columns = (type_of(node), default, constraints(node), meaning)
    return f"| `{path}` | " + " | ".join(cell(text) for text in columns) + " |"


def rules(schema: dict[str, Any]) -> list[str]:
    """The CEL rules, each under the object it is declared on, by its message."""
    found = list(_rules(schema, ""))
    if not found:
        return []
    out = ["### Validation rules", "", "Checked by the API server on every write, beside the ranges above.",
           "", "| on | refused with |", "| --- | --- |"]
    out += [f"| `{path or '(the object)'}` | {cell(' '.join(message.split()))} |" for path, message in found]
    return [*out, ""]


def _rules(node: dict[str, Any], path: str) -> Iterator[tuple[str, str]]:
    for rule in node.get("x-kubernetes-validations") or []:
        target = f"{path}{rule.get('fieldPath', '')}" if rule.get("fieldPath") else path
        yield target.lstrip("."), rule.get("message") or rule["rule"]
    for name, child in (node.get("properties") or {}).items():
        yield from _rules(child, f"{path}.{name}")
    for nested, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(nested), dict):
            yield from _rules(node[nested], f"{path}{suffix}")
