"""Synthetic stand-ins for real models, for tests, benchmarks and the bundled model (the ones only
tests use are in tests/helpers).

tokenizer   a character-level tokenizer with Dream's special tokens (the bundled model's tokenizer)
checkpoint  random checkpoints of every family and PEFT LoRA adapters in the exact on-disk formats
posterior   an executor answering with the bundled task suite's exact posteriors (its TPF ceiling)
"""

from lopa.synthetic.checkpoint import (
    tiny_config,
    write_random_checkpoint,
    write_random_lora_adapter,
)
from lopa.synthetic.tokenizer import (
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
