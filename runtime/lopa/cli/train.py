"""`lopa train-bundled`: train the bundled model from scratch (one flag per TrainConfig field)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from lopa.training import TrainConfig, train

HELP = {
    "steps": "optimizer steps",
    "seed": "seed of the data stream, the init and the noise",
    "batch_size": "examples per step",
    "lr": "peak learning rate (linear warmup, cosine decay to 10%%)",
    "warmup": "warmup steps",
    "weight_decay": "AdamW weight decay of matrices",
    "block_size": "D2F block size the model is trained for",
    "gen_blocks": "generated blocks per example (answer + EOS, EOS-padded)",
    "full_attention_fraction": "fraction of rows trained with full attention (rest block-causal)",
    "hidden_size": "model width",
    "intermediate_size": "SwiGLU width",
    "layers": "decoder layers",
    "heads": "query heads",
    "kv_heads": "key/value heads (GQA)",
    "max_position_embeddings": "longest sequence the checkpoint accepts",
    "threads": "torch CPU threads (1 is faster than 2 on a busy 2-core machine)",
    "log_every": "print progress every N steps",
    "save_every": "write the checkpoint every N steps (0 = only at the end)",
    "max_minutes": "stop and save after this much wall time (0 = no limit)",
    "family": "checkpoint format and logit reading: dream (shifted logits) or llada (own-position logits)",
}
CHOICES = {"family": ("dream", "llada")}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-bundled",
        help="train the bundled D2F model from scratch on the task suite (CPU)",
        description="Train a small model (Dream or LLaDA format) with D2F's block-wise masked-diffusion "
        "objective.",
    )
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    defaults = TrainConfig()
    for field in fields(TrainConfig):
        default = getattr(defaults, field.name)
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=type(default),
            default=default,
            choices=CHOICES.get(field.name),
            help=f"{HELP[field.name]} (default: {default})",
        )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    train(config, args.out)
    return 0
