"""PNG figures of the bench reports (matplotlib without a display)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def figure(path: str | Path, columns: int = 1, width: float = 6.4) -> Iterator[Any]:
    """Axes to draw on (one, or a tuple of `columns`); the figure is written to `path` on exit."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=(width * columns if columns > 1 else width, 4.2), dpi=120)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(Path(path))
    finally:
        plt.close(fig)
