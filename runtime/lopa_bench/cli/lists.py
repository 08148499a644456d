"""The comma-separated lists of the bench commands' flags (--ks, --modes), each checked under its flag."""

from __future__ import annotations

from lopa.params import MAX_BRANCHES, AttentionMode, InvalidParameter


def parse_ks(text: str) -> list[int]:
    """--ks "0,1,2": each k in [0, MAX_BRANCHES]; InvalidParameter names --ks (not --branches)."""
    ks = []
    for item in _items(text, "ks"):
        if not item.isdigit() or int(item) > MAX_BRANCHES:
            raise InvalidParameter("ks", f"each k must be an integer in [0, {MAX_BRANCHES}], got {item!r}")
        ks.append(int(item))
    return ks


def parse_modes(text: str) -> list[str]:
    """--modes "block_causal,full": attention modes; InvalidParameter names --modes (not --attention)."""
    known = [m.value for m in AttentionMode]
    modes = _items(text, "modes")
    for mode in modes:
        if mode not in known:
            raise InvalidParameter("modes", f"each mode must be one of {', '.join(known)}, got {mode!r}")
    return modes


def _items(text: str, name: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise InvalidParameter(name, "needs at least one comma-separated value")
    return items
