"""Loading a checkpoint's tokenizer with transformers, never running remote code."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lopa.model.errors import CheckpointError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(tokenizer_dir: str | Path) -> Any:
    """A transformers tokenizer from local files.

    Dream's own repos point AutoTokenizer at remote code (a Qwen2 BPE tokenizer under another
    name); when AutoTokenizer refuses, the same vocab.json/merges.txt load with transformers'
    built-in Qwen2 tokenizer.
    """
    tokenizer_dir = Path(tokenizer_dir)
    if not any((tokenizer_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(tokenizer_dir / "tokenizer.json", "no tokenizer files found (tokenizer.json)")
    import transformers  # deferred: importing transformers costs seconds

    try:
        with _quiet(transformers):
            return transformers.AutoTokenizer.from_pretrained(
                str(tokenizer_dir), local_files_only=True, trust_remote_code=False
            )
    except Exception as exc:  # transformers raises many types here (ValueError, OSError, ...)
        error: Exception = exc
    if (tokenizer_dir / "vocab.json").is_file() and (tokenizer_dir / "merges.txt").is_file():
        qwen2 = getattr(transformers, "Qwen2TokenizerFast", None) or transformers.Qwen2Tokenizer
        try:
            with _quiet(transformers):
                return qwen2.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except Exception as exc:
            error = exc
    raise CheckpointError(tokenizer_dir / "tokenizer_config.json", f"cannot load the tokenizer: {error}")


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """Silence transformers' chatter about config.json's model_type (Dream is unknown to it)."""
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
