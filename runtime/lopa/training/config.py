"""Hyper-parameters of `lopa train-bundled`: the model shape and the block-diffusion recipe."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lopa.model.config import ModelConfig
from lopa.synthetic.tokenizer import TOKENIZER_VOCAB_SIZE, special_token_id


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 5000
    seed: int = 0
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    block_size: int = 8
    gen_blocks: int = 4  # generated region per example: answer + EOS, EOS-padded to this many blocks
    full_attention_fraction: float = 0.5  # rows trained with full attention (the rest block-causal)
    hidden_size: int = 128
    intermediate_size: int = 384
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    max_position_embeddings: int = 256
    threads: int = 2
    log_every: int = 50
    save_every: int = 500
    max_minutes: float = 0.0  # stop early (and save) after this wall time; 0 = no limit
    family: str = "dream"  # the checkpoint format and logit reading (lopa.model.families)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_config(config: TrainConfig) -> ModelConfig:
    """A config of the recipe's family over the character tokenizer of lopa.synthetic (ids from that
    tokenizer); q/k/v biases as the family has them."""
    eos = special_token_id("<|endoftext|>")
    return ModelConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=config.max_position_embeddings,
        mask_token_id=special_token_id("<|mask|>"),
        eos_token_ids=(eos,),
        pad_token_id=eos,
        bos_token_id=eos,
        tie_word_embeddings=False,
        qkv_bias=config.family == "dream",
        family=config.family,
    )
