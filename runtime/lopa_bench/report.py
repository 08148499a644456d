"""Rendering a Sweep: a text table, a JSON file and a PNG plot like the LoPA paper's Figure 4."""

from __future__ import annotations

import json
from pathlib import Path

from lopa_bench.tpf import Sweep

COLUMNS = ("attention", "k", "EM %", "TPF", "pad TPF", "forwards", "tokens", "tok/s", "step ms")


def table(sweep: Sweep) -> str:
    rows = [COLUMNS]
    for c in sweep.cells:
        rows.append(
            (
                c.attention,
                str(c.branches),
                f"{100 * c.exact_match:.1f}",
                f"{c.tpf:.2f}",
                f"{c.padded_tpf:.2f}",
                str(c.forwards),
                str(c.tokens),
                f"{c.tokens_per_s:.1f}",
                f"{c.step_ms:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for mode, s in sweep.speedups().items():
        lines.append(
            f"{mode}: best k={s['best_k']}: TPF x{s['tpf_ratio']:.2f}, "
            f"EM {s['accuracy_delta_points']:+.1f} pts, tok/s x{s['tokens_per_s_ratio']:.2f} "
            f"(fastest k={s['fastest_k']}: x{s['best_tokens_per_s_ratio']:.2f})"
        )
    return "\n".join(lines)


def write_json(sweep: Sweep, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(sweep.to_dict(), indent=2) + "\n")
    return path


def plot(sweep: Sweep, path: str | Path) -> Path:
    """TPF (left axis, solid) and exact match (right axis, dashed) against k, one colour per mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, tpf_axis = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    em_axis = tpf_axis.twinx()
    for colour, mode in zip(
        ("tab:blue", "tab:orange"), sorted({c.attention for c in sweep.cells}), strict=False
    ):
        cells = sorted((c for c in sweep.cells if c.attention == mode), key=lambda c: c.branches)
        ks = [c.branches for c in cells]
        tpf_axis.plot(ks, [c.tpf for c in cells], "o-", color=colour, label=f"TPF ({mode})")
        em_axis.plot(
            ks, [100 * c.exact_match for c in cells], "s--", color=colour, alpha=0.6, label=f"EM ({mode})"
        )
    tpf_axis.set_xlabel("lookahead branches k (0 = D2F)")
    tpf_axis.set_ylabel("tokens per forward")
    em_axis.set_ylabel("exact match (%)")
    em_axis.set_ylim(0, 105)
    tpf_axis.set_ylim(bottom=0)
    handles = tpf_axis.get_legend_handles_labels()[0] + em_axis.get_legend_handles_labels()[0]
    labels = tpf_axis.get_legend_handles_labels()[1] + em_axis.get_legend_handles_labels()[1]
    tpf_axis.legend(handles, labels, loc="lower right", fontsize=8)
    tpf_axis.set_title(f"LoPA vs D2F on the bundled model ({sweep.examples} held-out prompts)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
