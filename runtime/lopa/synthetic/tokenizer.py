"""A small character-level tokenizer with Dream's special tokens, saved in the Hugging Face layout.

Ids 0..96 are printable ASCII plus newline and tab; the special tokens follow, like in Dream
(where they sit after the regular vocabulary). AutoTokenizer loads the result as a fast tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

_CHARS = [chr(code) for code in range(32, 127)] + ["\n", "\t"]
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|unk|>")
TOKENIZER_VOCAB_SIZE = len(_CHARS) + len(SPECIAL_TOKENS)


def special_token_id(token: str) -> int:
    return len(_CHARS) + SPECIAL_TOKENS.index(token)


def write_char_tokenizer(directory: str | Path, chat_template: str | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into directory;
    tokenizer_config.json carries `chat_template` when given (none by default)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(_CHARS)}
    vocab.update({token: special_token_id(token) for token in SPECIAL_TOKENS})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    # One token per character ([\s\S] so newlines split too); Fuse joins them back without spaces.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "unk_token": "<|unk|>",
    }
    config: dict[str, str | int] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
                                    **special}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
