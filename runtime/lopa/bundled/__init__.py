"""The bundled models and their task suite (see bundled/model/MODEL_CARD.md).

`model/` is the embedded default, a Dream-format model; `llada/` the same recipe in the LLaDA
format (own-position logits, LLaDA's names and config keys), trained on the same data.

tasks     the task suite: hide the end of each word, where the filling order sets the speed
chat      the chat template: a chat asks what a completion of its task prompt asks
"""

from pathlib import Path


def bundled_model_dir() -> Path:
    """The small D2F model shipped inside the package (the embedded default)."""
    return Path(__file__).resolve().parent / "model"


def bundled_llada_dir() -> Path:
    """The small LLaDA-format D2F model shipped beside it (bundled/llada/MODEL_CARD.md)."""
    return Path(__file__).resolve().parent / "llada"
