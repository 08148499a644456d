"""Loading a checkpoint's tokenizer with transformers, never running remote code."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lopa.model.errors import CheckpointError
from lopa.params import InvalidParameter

NO_CHAT_TEMPLATE = (
    "the model has no chat template (tokenizer_config.json has no chat_template); send a plain prompt"
)


def load_tokenizer(tokenizer_dir: str | Path) -> Any:
    """A transformers tokenizer from local files.

    Dream's own repos point AutoTokenizer at remote code (a Qwen2 BPE tokenizer under another
    name); when AutoTokenizer refuses, the same vocab.json/merges.txt load with transformers'
    built-in Qwen2 tokenizer.
    """
    tokenizer_dir = Path(tokenizer_dir)
    fast, bpe = tokenizer_dir / "tokenizer.json", tokenizer_dir / "vocab.json"
    if not (fast.is_file() or (bpe.is_file() and (tokenizer_dir / "merges.txt").is_file())):
        # Without these transformers goes looking for sentencepiece / tiktoken and says so at length.
        raise CheckpointError(fast, "file not found (nor vocab.json + merges.txt)")
    if fast.is_file():
        _check_tokenizer_json(fast)
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
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise CheckpointError(tokenizer_dir / "tokenizer_config.json", f"cannot load the tokenizer: {first_line}")


def _check_tokenizer_json(path: Path) -> None:
    """A broken tokenizer.json is named as such (transformers blames tokenizer_config.json)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception subclass for parse errors
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(path, f"not a valid tokenizer file: {reason}") from None


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """`prompt` as one user turn of the checkpoint's chat template, ending where the reply starts.

    Raises InvalidParameter("chat") when the checkpoint has no template (transformers' own error
    is a ValueError that reads like a crash).
    """
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}])


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation through the checkpoint's chat template, ending where the reply starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidParameter("chat", NO_CHAT_TEMPLATE)
    # Render then encode: apply_chat_template's tokenized return type differs across transformers
    # versions (a list of ids in 4.x, a BatchEncoding in 5.x); the template holds its own specials.
    from jinja2.exceptions import TemplateError  # transformers renders templates with jinja2

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as error:  # e.g. the template's raise_exception("roles must alternate")
        raise InvalidParameter("chat", f"the model's chat template refused the messages: {error}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


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
