"""A mixed load for batching checks: 16 held-out prompts of the bundled model with different k,
attention modes, lengths and stop strings, two of them sampled with a seed.

One definition shared by the local-engine and the serving tests, so "the same 16 requests alone and
together" means the same thing on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lopa.bundled import bundled_model_dir, tasks
from lopa.model.decoding_defaults import model_defaults
from lopa.params import DecodingParams

BRANCHES = (0, 1, 3, 5)
SAMPLED = (5, 10)  # these two use temperature 0.7 with their own seed


@dataclass(frozen=True)
class MixedRequest:
    prompt: str
    params: DecodingParams
    stop: list[str] = field(default_factory=list)

    def overrides(self) -> dict[str, object]:
        """What a gRPC client sets so that the server's bundled-model defaults become self.params."""
        p = self.params
        out: dict[str, object] = {"branches": p.branches, "attention": p.attention,
                                  "max_new_tokens": p.max_new_tokens}
        if p.temperature:
            out.update(temperature=p.temperature, seed=p.seed)
        return out


def mixed_requests(n: int = 16) -> list[MixedRequest]:
    defaults = model_defaults(bundled_model_dir())
    out = []
    for i, example in enumerate(tasks.held_out(n)):
        params = defaults.with_overrides(
            branches=BRANCHES[i % 4],
            attention=("full", "block_causal")[(i // 4) % 2],
            max_new_tokens=(32, 16, 24)[i % 3],
            **({"temperature": 0.7, "seed": 11 + i} if i in SAMPLED else {}),
        )
        stop = ["."] if i % 5 == 2 else []  # cuts the answer at its first dot
        out.append(MixedRequest(example.prompt, params, stop))
    return out
