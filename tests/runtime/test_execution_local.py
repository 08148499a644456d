"""LocalExecutor.verify_many: one ragged forward for several requests, each part's statistics the
ones it gets alone (greedy parts with the same settings are reduced together)."""

from __future__ import annotations

import random

import torch

from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part
from lopa.engine import bundled_model_dir
from lopa.execution.local import LocalExecutor
from lopa.model import WindowedLM
from lopa.model.loader import load_model
from lopa.params import ConfKind, DecodingParams
from lopa.synthetic import tiny_config
from lopa.synthetic.checkpoint import random_model

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
        assert outcome == verify_part(alone, part)
        assert [len(stats) for stats in outcome] == [len(w.masked) for w in part.windows]
    # Parts 0 and 2 share their settings and their windows' statistics differ: no mix-up.
    assert outcomes[0] != outcomes[2]


def test_a_lone_masked_position_of_a_large_vocabulary_gets_its_own_bits(thread_count) -> None:
    """Torch reduces one row of >= 32768 logits across threads but a row among several within one
    thread: a part's only masked position then gets another negative entropy beside other parts
    than alone (about half the rows at 2 threads, vocabulary 40000). Such a part keeps its own
    reduction: eight of them beside a part of several positions each get their bits alone."""
    config = tiny_config(vocab_size=40_000, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    model = random_model(config, torch.float32, "cpu", seed=3)
    params = DecodingParams(conf=ConfKind.NEG_ENTROPY)
    lone = [VerifyPart(s, 0, 0, [BranchWindow([5 + s, 6, 7, 8], [1] * 4, [2])]) for s in range(8)]
    parts = [*lone, VerifyPart(8, 0, 0, _windows(11, 2))]
    thread_count(2)
    together, alone = (LocalExecutor(WindowedLM(model, 64, max_batch=len(parts))) for _ in range(2))
    for executor in (together, alone):
        for part in parts:
            executor.begin(params, 3, part.sequence)
    outcomes = together.verify_many(parts)
    for part, outcome in zip(parts, outcomes, strict=True):
        assert outcome == verify_part(alone, part)


def test_a_round_copies_its_parts_statistics_to_the_host_once(monkeypatch) -> None:
    # Sampled parts (and, on an accelerator, every part) reduce on the device one by one; their
    # values reach the host in one copy, a synchronisation per round instead of one per request.
    import lopa.execution.local as local

    loaded = load_model(bundled_model_dir())
    params = [DecodingParams(temperature=0.8, seed=s) for s in range(4)]
    together = LocalExecutor(loaded.window_model(64, max_batch=4))
    alone = LocalExecutor(loaded.window_model(64, max_batch=4))
    parts = [VerifyPart(s, 0, 0, _windows(20 + s, 1 + s % 3)) for s in range(4)]
    for executor in (together, alone):
        for sequence, p in enumerate(params):
            executor.begin(p, 3, sequence)
    copies = []
    real = local._to_host
    monkeypatch.setattr(local, "_to_host", lambda *stats: copies.append(1) or real(*stats))
    outcomes = together.verify_many(parts)
    assert len(copies) == 1
    for part, outcome in zip(parts, outcomes, strict=True):
        assert outcome == verify_part(alone, part)
        assert [len(stats) for stats in outcome] == [len(w.masked) for w in part.windows]


def test_the_stored_last_logit_keeps_only_its_own_row() -> None:
    """Committing a round keeps the winner's last logit, not a view of the round's logits tensor
    (which holds every request's outputs: up to max_batch such tensors stayed alive)."""
    from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part
    from tests.helpers.rule_model import SyntheticModel

    model = SyntheticModel(20, 64, lambda sequence, position: torch.ones(20), max_batch=2)
    executor = LocalExecutor(model)
    executor.begin(DecodingParams(branches=1), 2)
    windows = [BranchWindow([1, 2, 19, 19], [0, 0, 1, 1], [2, 3]) for _ in range(2)]
    verify_part(executor, VerifyPart(0, 0, 2, windows))
    executor.commit_many([(0, 1)])
    stored = executor.state(0).last_logit
    assert stored is not None
    assert stored.untyped_storage().nbytes() == stored.numel() * stored.element_size()
