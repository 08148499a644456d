"""LocalExecutor.verify_many: one ragged forward for several requests, each part's statistics the
ones it gets alone (greedy parts with the same settings are reduced together)."""

from __future__ import annotations

import random

from lopa.decoding.executor import BranchWindow
from lopa.engine import bundled_model_dir
from lopa.execution.local import LocalExecutor, VerifyPart
from lopa.model.loader import load_model
from lopa.params import ConfKind, DecodingParams

PARAMS = [
    DecodingParams(),
    DecodingParams(conf=ConfKind.PROB),
    DecodingParams(),  # the same settings as part 0: reduced with it
    DecodingParams(conf=ConfKind.MARGIN),
    DecodingParams(temperature=0.7, seed=5),  # sampled from its own streams
]


def _windows(seed: int, rows: int) -> list[BranchWindow]:
    rng = random.Random(seed)
    windows = []
    for _ in range(rows):
        width = rng.randint(3, 12)
        tokens = [rng.randrange(90) for _ in range(width)]
        masked = sorted(rng.sample(range(width), rng.randint(1, width)))  # position 0: the stored logit
        windows.append(BranchWindow(tokens, [1] * width, masked))
    return windows


def test_each_part_gets_the_statistics_it_gets_alone() -> None:
    loaded = load_model(bundled_model_dir())
    together = LocalExecutor(loaded.window_model(64, max_batch=len(PARAMS)))
    alone = LocalExecutor(loaded.window_model(64, max_batch=len(PARAMS)))
    parts = [VerifyPart(s, 0, 0, _windows(s, 1 + s % 3)) for s in range(len(PARAMS))]
    for executor in (together, alone):
        for sequence, params in enumerate(PARAMS):
            executor.begin(params, 3, sequence)
    outcomes = together.verify_many(parts)
    for part, outcome in zip(parts, outcomes, strict=True):
        assert not isinstance(outcome, Exception)
        assert outcome == alone.verify(part.start, part.n_stage, part.windows, part.sequence)
        assert [len(stats) for stats in outcome] == [len(w.masked) for w in part.windows]
    # Parts 0 and 2 share their settings and their windows' statistics differ: no mix-up.
    assert outcomes[0] != outcomes[2]
