"""Which rounds take the model's pass over the vocabulary (lopa.execution.vocab_pass): greedy
rounds without top-p / top-k, excluded tokens or a stale logit; the others reduce logits. The
pass itself runs in tests/runtime/kernels/test_model_kernels.py (interpreted) and on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lopa.decoding.executor import BranchWindow, VerifyPart
from lopa.execution.local import OutputPlan, SequenceState
from lopa.execution.vocab_pass import reductions
from lopa.params import ConfKind, DecodingParams

CPU = torch.device("cpu")
GPU_MODEL = SimpleNamespace(vocab_pass=True)  # what a WindowedLM running its kernels says


def _part(sequence: int, start: int = 10) -> tuple[VerifyPart, OutputPlan]:
    window = BranchWindow([1, 2, 9, 9], [1, 1, 2, 2], [start + 2, start + 3])
    return VerifyPart(sequence, start, 1, [window]), OutputPlan(start, 1, [window])


def test_greedy_rounds_take_the_pass_with_each_parts_masked_count_and_conf() -> None:
    margin = DecodingParams(conf=ConfKind.MARGIN)
    states = {0: SequenceState(DecodingParams(), CPU), 1: SequenceState(margin, CPU)}
    (a, plan_a), (b, plan_b) = _part(0), _part(1)
    assert reductions(GPU_MODEL, states, [a, b], [plan_a, plan_b]) == [
        (2, ConfKind.NEG_ENTROPY), (2, ConfKind.MARGIN)]
    assert reductions(SimpleNamespace(vocab_pass=False), states, [a], [plan_a]) is None
    assert reductions(object(), states, [a], [plan_a]) is None  # a model without the pass


def test_rounds_the_pass_cannot_reduce_keep_their_logits() -> None:
    part, plan = _part(0)
    for params in (DecodingParams(temperature=0.7), DecodingParams(top_p=0.9), DecodingParams(top_k=5)):
        assert reductions(GPU_MODEL, {0: SequenceState(params, CPU)}, [part], [plan]) is None
    excluded = SequenceState(DecodingParams(), CPU, excluded=torch.tensor([3]))
    assert reductions(GPU_MODEL, {0: excluded}, [part], [plan]) is None
    window = BranchWindow([9, 2, 9], [1, 1, 1], [0, 2])  # window index 0 masked: D2F's stored logit
    stale = (VerifyPart(0, 0, 0, [window]), OutputPlan(0, 0, [window]))
    assert stale[1].from_stored
    assert reductions(GPU_MODEL, {0: SequenceState(DecodingParams(), CPU)}, [stale[0]], [stale[1]]) is None
