"""One command-line flag per DecodingParams field, with the paper's defaults in the help."""

from __future__ import annotations

import argparse
from dataclasses import fields

from lopa.params import CHOICE_SETTINGS, DecodingParams

HELP = {
    "block_size": "positions per generated block; the paper uses 16 for MATH-like tasks",
    "max_new_tokens": "the answer's length at most (decoded in whole blocks of block_size)",
    "tau_add": "append a block once the last block is this fraction decoded",
    "tau_act": "fully activate the next block once a block is this fraction decoded",
    "tau_conf": "fill positions whose P(x_hat) is strictly above this",
    "branches": "lookahead branches k (0 = D2F baseline; the anchor is not counted)",
    "conf": "confidence used to rank positions and score branches",
    "alpha": "weight of the branch-creation confidence in the branch score",
    "beta": "fraction of the lowest future confidences averaged in the score (1 = mean)",
    "branch_score": "branch score: mean (the paper's, with alpha and beta), block_min (the least "
    "confident block's mean) or fills (the tokens the round would commit)",
    "branch_policy": "fixed (k lookaheads every round) or auto (k is the ceiling: all after a "
    "stalled round, fewer after a round whose anchor filled much)",
    "attention": "full (LoPA default) or block_causal (original D2F)",
    "temperature": "0 = greedy; > 0 samples x_hat",
    "top_p": "nucleus sampling mass (1 = off)",
    "top_k": "top-k filter (0 = off)",
    "min_p": "min-p filter: keep tokens of at least min_p times the top token's probability (0 = off)",
    "seed": "sampling seed: a request with the same seed samples the same answer",
}
# Fields whose default is None, and the type of their flag.
OPTIONAL_TYPES = {"seed": int}
NO_DEFAULT = {"seed": "a fresh draw per request"}
CHOICES = {name: [choice.value for choice in kind] for name, kind in CHOICE_SETTINGS.items()}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """Flags default to None: unset ones fall back to the model's lopa_defaults.json, then the paper."""
    paper = DecodingParams()
    group = parser.add_argument_group(
        "decoding (docs/decoding.md; defaults follow the LoPA paper unless the model ships "
        "lopa_defaults.json)"
    )
    for field in fields(DecodingParams):
        default = getattr(paper, field.name)
        default = getattr(default, "value", default)
        group.add_argument(
            flag_name(field.name),
            dest=field.name,
            type=OPTIONAL_TYPES.get(field.name, type(default)),
            default=None,
            choices=CHOICES.get(field.name),
            help=f"{HELP[field.name]} (default: {NO_DEFAULT[field.name]})"
            if field.name in NO_DEFAULT
            else f"{HELP[field.name]} (paper default: {default})",
        )


def params_from_args(args: argparse.Namespace, base: DecodingParams | None = None) -> DecodingParams:
    """`base` (a model's defaults) with every flag that was given; validated.

    InvalidParameter names the field; the CLI maps it back to its flag.
    """
    given = {f.name: getattr(args, f.name) for f in fields(DecodingParams)}
    return (base or DecodingParams()).with_overrides(**given)
