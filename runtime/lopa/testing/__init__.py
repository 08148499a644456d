"""Helpers for tests and demos: tiny random Dream checkpoints, tokenizers and LoRA adapters on disk."""

from lopa.testing.checkpoint import (
    tiny_config,
    write_random_checkpoint,
    write_random_lora_adapter,
)
from lopa.testing.tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    special_token_id,
    write_char_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "special_token_id",
    "tiny_config",
    "write_char_tokenizer",
    "write_random_checkpoint",
    "write_random_lora_adapter",
]
