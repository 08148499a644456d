"""The bundled model and its task suite (see bundled/model/MODEL_CARD.md)."""

from pathlib import Path


def bundled_model_dir() -> Path:
    """The small D2F model shipped inside the package (the embedded default)."""
    return Path(__file__).resolve().parent / "model"
