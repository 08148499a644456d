"""Loading a checkpoint's tokenizer with transformers, never running remote code."""

from __future__ import annotations

import contextlib
import json
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

    For a model type transformers does not know (Dream's) AutoTokenizer comes down to the class
    tokenizer_config.json names (`_declared_class`): that class is loaded directly, since
    AutoTokenizer's config machinery imports torch (two seconds, and a master holds no model).
    """
    tokenizer_dir = Path(tokenizer_dir)
    fast, bpe = tokenizer_dir / "tokenizer.json", tokenizer_dir / "vocab.json"
    if not (fast.is_file() or (bpe.is_file() and (tokenizer_dir / "merges.txt").is_file())):
        # Without these transformers goes looking for sentencepiece / tiktoken and says so at length.
        raise CheckpointError(fast, "file not found (nor vocab.json + merges.txt)")
    if fast.is_file():
        _check_tokenizer_json(fast)
    import transformers  # deferred: importing transformers costs a second

    declared = _declared_class(tokenizer_dir, transformers)
    error: Exception = ValueError("tokenizer_config.json names remote code (auto_map), which is never run")
    if declared is not REMOTE_CODE:
        try:
            with _quiet(transformers):
                if declared is not None:
                    return declared.from_pretrained(str(tokenizer_dir), local_files_only=True)
                return transformers.AutoTokenizer.from_pretrained(
                    str(tokenizer_dir), local_files_only=True, trust_remote_code=False
                )
        except Exception as exc:  # transformers raises many types here (ValueError, OSError, ...)
            error = exc
    if (tokenizer_dir / "vocab.json").is_file() and (tokenizer_dir / "merges.txt").is_file():
        qwen2 = getattr(transformers, "Qwen2TokenizerFast", None) or transformers.Qwen2Tokenizer
        try:
            with _quiet(transformers):
                return qwen2.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except Exception as exc:
            error = exc
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise CheckpointError(tokenizer_dir / "tokenizer_config.json", f"cannot load the tokenizer: {first_line}")


# Model types transformers maps to no tokenizer (config.json's model_type): AutoTokenizer then takes
# the class tokenizer_config.json names.
UNMAPPED_MODEL_TYPES = frozenset({"Dream", "llada"})
REMOTE_CODE = object()  # `_declared_class`: AutoTokenizer would refuse the directory (remote code)


def _declared_class(tokenizer_dir: Path, transformers: Any) -> Any:
    """The tokenizer class AutoTokenizer picks for a model type in UNMAPPED_MODEL_TYPES, found the
    way it finds it (the name without "Fast", else with it; the Python backend and a name it lacks
    become the tokenizers backend), or REMOTE_CODE where it would refuse (an auto_map naming a class
    transformers lacks). None where another rule of AutoTokenizer's may apply: AutoTokenizer decides."""
    try:
        model_type = json.loads((tokenizer_dir / "config.json").read_text()).get("model_type")
        declared = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        name = declared.get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # AutoTokenizer names what is wrong
        return None
    if model_type not in UNMAPPED_MODEL_TYPES or not isinstance(name, str):
        return None
    name = name.removesuffix("Fast")
    found = getattr(transformers, name, None) or getattr(transformers, f"{name}Fast", None)
    if found is None and declared.get("auto_map"):
        return REMOTE_CODE
    if found is None or found is transformers.PythonBackend:
        return transformers.TokenizersBackend
    tokenizer = isinstance(found, type) and issubclass(found, transformers.PreTrainedTokenizerBase)
    return found if tokenizer else None


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
