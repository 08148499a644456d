"""When a round's statistics come from the model's pass over the vocabulary instead of logits.

A GPU model running its kernels reduces the masked positions' logits to (x_hat, P, Conf) inside the
lm_head (WindowedLM.forward_many_stats, lopa.kernels.vocab_stats): the [positions, vocab]
logits never reach memory. That pass computes greedy statistics only, from the model's own logits:
a round takes it when every part is greedy without top-p / top-k, excludes no token (ignore_eos),
asks for no alternatives (top_logprobs: they need the whole distribution) and has no masked
position at window index 0 (D2F's stale logit: its row is the stored logit, not a forward's
output). Otherwise the round returns logits and the executor reduces them
(lopa.execution.sampling), as on a CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lopa.decoding.executor import VerifyPart
from lopa.params import ConfKind, DecodingParams


def reducible(params: DecodingParams) -> bool:
    return params.greedy and params.top_p >= 1.0 and params.top_k == 0 and params.min_p == 0


def reductions(
    model: Any, states: Mapping[int, Any], parts: Sequence[VerifyPart], plans: Sequence[Any]
) -> list[tuple[int, ConfKind]] | None:
    """(masked positions, Conf kind) of each part when the round can take the model's vocabulary
    pass (see the module docstring), else None. states: the executor's SequenceState by sequence;
    plans: each part's OutputPlan."""
    if not getattr(model, "vocab_pass", False):
        return None
    out = []
    for part, plan in zip(parts, plans, strict=True):
        state = states.get(part.sequence)
        if (state is None or not reducible(state.params) or state.excluded is not None or plan.from_stored
                or state.alternatives):
            return None
        out.append((plan.n_masked, state.params.conf))
    return out
