"""One rank's share of a round (lopa.execution.shard): the fused commit buffer between ranks."""

from __future__ import annotations

from pathlib import Path

import torch

from lopa.decoding.executor import BranchWindow, VerifyPart
from lopa.execution.local import LocalExecutor
from lopa.execution.shard import CommitOrder, ShardExecutor
from lopa.model.loader import load_model
from lopa.params import DecodingParams


def test_fused_commit_buffer_round_trips(family_checkpoint: Path) -> None:
    """Two requests won on one rank travel in ONE broadcast (each request's K/V of every layer + its
    fp32 last logit with Dream's shift; K/V alone for LLaDA, which stores no logit) and rebuild, on
    the receiver, the state of running each request locally."""
    loaded = load_model(family_checkpoint)
    sent: list[torch.Tensor] = []
    winner = ShardExecutor(loaded.window_model(64, max_batch=3), 0, lambda buf, src: sent.append(buf.clone()))
    receiver = ShardExecutor(loaded.window_model(64, max_batch=3), 1, lambda buf, src: buf.copy_(sent[-1]))
    reference = LocalExecutor(loaded.window_model(64, max_batch=3))
    params = DecodingParams(block_size=8, max_new_tokens=16, branches=1)
    rows = {
        0: [BranchWindow([5, 6, 7, 8, 100, 100], [0, 0, 0, 0, 1, 1], [4, 5]),
            BranchWindow([5, 6, 7, 8, 100, 9], [0, 0, 0, 0, 1, 1], [4])],
        2: [BranchWindow([9, 3, 100, 100, 100], [0, 0, 1, 1, 1], [2, 3, 4]),
            BranchWindow([9, 3, 4, 100, 100], [0, 0, 1, 1, 1], [3, 4])],
    }
    n_stage = {0: 4, 2: 2}
    for ex in (winner, receiver, reference):
        for sequence in rows:
            ex.begin(params, 2, sequence)
    winner.verify_round([VerifyPart(s, 0, n_stage[s], rows[s]) for s in rows])
    reference.verify_many([VerifyPart(s, 0, n_stage[s], rows[s]) for s in rows])
    receiver.verify_round([VerifyPart(s, 0, n_stage[s], []) for s in rows])
    commits = [CommitOrder(0, 4, 0, 1, True), CommitOrder(2, 2, 0, 0, True)]
    winner.commit_round(commits)
    receiver.commit_round(commits)
    reference.commit_many([(0, 1), (2, 0)])
    assert len(sent) == 1 and sent[0].dtype == torch.uint8  # one fused broadcast for both requests
    for sequence, n in n_stage.items():
        kv, ref_kv = receiver.model.caches[sequence], reference.model.caches[sequence]
        assert kv.length == ref_kv.length == n
        assert torch.equal(kv.cache[:, :, :n], ref_kv.cache[:, :, :n])
        received, expected = receiver.local.state(sequence).last_logit, reference.state(sequence).last_logit
        if loaded.config.logit_shift:
            assert torch.equal(received, expected)
        else:
            assert received is None and expected is None
    kv = receiver.model.caches[0]
    logit_bytes = loaded.config.vocab_size * 4 if loaded.config.logit_shift else 0
    packed = sum(kv.packed_shape(n).numel() * kv.cache.element_size() for n in n_stage.values())
    assert sent[0].numel() == packed + 2 * logit_bytes
