"""The CUDA graph path of a round, checked on the CPU: the same packing, placement and body, run
without capture (WindowGraphs(capture=False) runs the body on every replay). Capture and replay
themselves run in tests/runtime/test_cuda.py on a GPU.

The body attends as accelerators do (rows folded into one sequence), the CPU's eager forward row
by row, so the two agree to rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from round_cases import MAX_LENGTH, ROUNDS, play_rounds, round_batch

from lopa.engine import bundled_model_dir
from lopa.model import DiffusionLM, WindowedLM
from lopa.model.cuda_graphs import WindowGraphs, round_staging
from lopa.model.graph_layout import MAX_LAYOUT_TOKENS, Bucket
from lopa.model.loader import load_model
from lopa.model.protocol import WindowBatch
from lopa.model.window import GRAPH_TOKENS_ENV, graph_capture_tokens, graph_staging
from lopa.params import AttentionMode
from lopa.synthetic.checkpoint import random_model, tiny_config
from lopa_bench.concurrency import captures_of


@pytest.fixture(scope="module")
def model() -> DiffusionLM:
    return load_model(bundled_model_dir()).model


def _graphed(
    model: DiffusionLM, max_length: int = MAX_LENGTH, max_batch: int = 4, capture_tokens: int | None = None
) -> WindowedLM:
    window = WindowedLM(model, max_length, max_batch=max_batch)
    window.graphs = WindowGraphs(model, window._physical, window.kv_storage, capture=False,
                                 capture_tokens=capture_tokens)

    def no_eager(*args: object) -> None:
        raise AssertionError("an eager forward where the graph path was expected")

    window._eager = no_eager  # type: ignore[method-assign]
    window._eager_many = no_eager  # type: ignore[method-assign]
    return window


def test_rounds_through_the_graph_path_equal_eager_rounds(model: DiffusionLM) -> None:
    eager, graphed = WindowedLM(model, MAX_LENGTH, max_batch=4), _graphed(model)

    def placed_in_front(sequences: Sequence[int]) -> None:
        # The round's requests now sit in the first physical caches, in some order.
        placed = {graphed._physical.index(graphed.caches[s]) for s in sequences}
        assert placed == set(range(len(sequences)))

    play_rounds(eager, graphed, ROUNDS, placed_in_front)
    assert graphed.graphs is not None and {b.requests for b in graphed.graphs.graphs} == {1, 2, 3, 4}
    for sequence in range(4):
        mine, theirs = graphed.caches[sequence], eager.caches[sequence]
        assert mine.length == theirs.length > 0
        torch.testing.assert_close(mine.cache[:, :, : mine.length], theirs.cache[:, :, : theirs.length],
                                   rtol=1e-4, atol=1e-4)


def test_rounds_larger_than_the_capture_limit_run_their_bucket_uncaptured(model: DiffusionLM) -> None:
    # LOPA_CUDA_GRAPH_TOKENS: a bucket of more linear tokens than the limit is never captured (its
    # body runs eagerly on every round, no capture counted); the others are, and every round still
    # equals the eager model's.
    eager, graphed = WindowedLM(model, MAX_LENGTH, max_batch=4), _graphed(model, capture_tokens=64)
    play_rounds(eager, graphed, ROUNDS)
    assert graphed.graphs is not None
    captured = [b for b in graphed.graphs.graphs if b.linear_tokens <= 64]
    uncaptured = [b for b in graphed.graphs.graphs if b.linear_tokens > 64]
    assert captured and uncaptured
    assert graphed.graph_captures()[0] == len(captured)
    assert graphed.forwards == {"graph": len(ROUNDS), "eager": 0}
    assert "up to 64 linear tokens" in graphed.graphs.describe()


def test_the_capture_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GRAPH_TOKENS_ENV, raising=False)
    assert graph_capture_tokens() is None
    monkeypatch.setenv(GRAPH_TOKENS_ENV, " 256 ")
    assert graph_capture_tokens() == 256
    for bad in ("-1", "lots", "2.5"):
        monkeypatch.setenv(GRAPH_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=f"{GRAPH_TOKENS_ENV}: must be an integer >= 0.*{bad!r}"):
            graph_capture_tokens()


def test_graph_rounds_read_a_cache_width_inside_longer_caches() -> None:
    # The bundled model's caches are shorter than one CACHE_STEP, so the rounds above read widths of
    # 0 or the whole cache; here the bucket reads 512 of 700 positions of caches holding 5-410
    # tokens, with garbage past each length (the masks must hide it).
    model = random_model(tiny_config(max_position_embeddings=1024), torch.float32, "cpu")
    eager, graphed = WindowedLM(model, 700, max_batch=4), _graphed(model, 700)
    for sequence, length in enumerate([260, 300, 5, 410]):
        packed = torch.randn(eager.caches[sequence].packed_shape(length),
                             generator=torch.Generator().manual_seed(sequence))
        for window in (eager, graphed):
            window.caches[sequence].append_packed(packed, length)
        graphed.kv_storage[sequence, :, :, length:] = 1e3
    play_rounds(eager, graphed, [[3, 0, 1], [1, 2], [0, 1, 2, 3]])
    assert graphed.graphs is not None and {b.cache_width for b in graphed.graphs.graphs} == {512}

def test_a_round_replays_the_graph_of_a_padded_request_count(model: DiffusionLM) -> None:
    # 5 requests replay the graph of 6 and 3 of 8 the one of 3: the padding request runs over a
    # cache holding another sequence's prefix (5 or 6, from the first round), which the last round
    # then reads: its logits and every cache must still equal the eager model's.
    eager, graphed = WindowedLM(model, MAX_LENGTH, max_batch=8), _graphed(model, max_batch=8)
    play_rounds(eager, graphed, [[5, 6], [0, 1, 2, 3, 4], [4, 2, 0, 1, 3], [5, 6, 0]])
    assert graphed.graphs is not None
    assert {b.requests for b in graphed.graphs.graphs} == {2, 6, 3}
    assert graphed.graph_captures()[0] == len(graphed.graphs.graphs) and eager.graph_captures() == (0, 0.0)
    for sequence in range(7):
        mine, theirs = graphed.caches[sequence], eager.caches[sequence]
        assert mine.length == theirs.length > 0
        torch.testing.assert_close(mine.cache[:, :, : mine.length], theirs.cache[:, :, : theirs.length],
                                   rtol=1e-4, atol=1e-4)


def test_a_padded_round_leaves_the_padding_caches_staging_alone(model: DiffusionLM) -> None:
    # The padding request stages only in the round's own buffer: what the cache beyond the round
    # had staged is still its own, and a commit of it still takes it.
    window = _graphed(model, max_batch=8)
    kv = window.caches[5]
    kv.begin_stage(1, 2)
    generator = torch.Generator().manual_seed(2)
    staged = torch.randn(kv.num_layers, 1, 3, kv.kv_heads, kv.head_dim, generator=generator)
    for layer in range(kv.num_layers):
        kv.stage(layer, staged[layer], -staged[layer])
    window.forward_many([round_batch(s, s, 0) for s in range(5)])  # replays the graph of 6 requests
    assert window.graphs is not None and {b.requests for b in window.graphs.graphs} == {6}
    assert window.caches[5] is window._physical[5] and kv.staged_count(0) == 2
    window.commit(0, 2, sequence=5)
    assert torch.equal(kv.cache[:, 0, :2], staged[:, 0, :2])
    assert torch.equal(kv.cache[:, 1, :2], -staged[:, 0, :2])


def test_a_batched_round_forgets_what_the_previous_one_staged_for_others(model: DiffusionLM) -> None:
    # Rounds of several requests share one staging buffer: a cache that staged there in one round
    # and was left out of the next cannot commit what the next overwrote.
    window = _graphed(model)
    window.forward_many([round_batch(s, s, 0) for s in (0, 1, 2)])
    assert window.caches[2].staged_count(0) > 0
    window.forward_many([round_batch(s + 3, s, 0) for s in (0, 1)])
    assert window.caches[2].staged_count(0) == 0
    with pytest.raises(ValueError, match="staged tokens"):
        window.commit(0, 1, sequence=2)


def test_a_round_forgets_what_its_bucket_s_padding_rows_overwrote(model: DiffusionLM) -> None:
    # A request of 1 row beside one of 4 runs in a bucket of 4 rows: its slots 1-3 were staged by
    # its previous round, and the padding rows overwrote them, so committing one must fail loudly.
    window = _graphed(model)
    generator = torch.Generator().manual_seed(5)

    def batch(sequence: int, rows: int) -> WindowBatch:
        tokens = torch.randint(0, 90, (rows, 8), generator=generator)
        return WindowBatch(tokens, [8] * rows, torch.zeros(rows, 8, dtype=torch.long), 0, 3,
                           AttentionMode.FULL, outputs=(0,), sequence=sequence)

    window.forward_many([batch(0, 4), batch(1, 1)])
    assert window.caches[0].staged_count(3) == 3
    window.forward_many([batch(0, 1), batch(1, 4)])
    assert window.caches[0].staged_count(0) == 3 and window.caches[0].staged_count(3) == 0
    with pytest.raises(ValueError, match="staged tokens"):
        window.commit(3, 3, sequence=0)


def test_batched_rounds_stage_in_their_own_buffer_whatever_their_width(model: DiffusionLM) -> None:
    # A staging area that grows drops the graphs holding its address. Batched rounds stage in one
    # buffer of the largest layout, so no batched window grows any cache's staging, and only cache
    # 0 (lone rounds) reserves some when graphs are on.
    assert graph_staging(1, 1, 4096) == (1, 0)
    window = _graphed(model)
    generations = [kv.staging_generation for kv in window._physical]
    generator = torch.Generator().manual_seed(3)
    width = MAX_LENGTH - 6
    batches = [
        WindowBatch(torch.randint(0, 90, (4, width), generator=generator), [width] * 4,
                    torch.zeros(4, width, dtype=torch.long), 0, 5, AttentionMode.FULL, outputs=(0, width),
                    sequence=sequence)
        for sequence in (0, 1)
    ]
    window.forward_many(batches)
    assert window.graphs is not None and {b.width for b in window.graphs.graphs} == {MAX_LENGTH}
    assert [kv.staging_generation for kv in window._physical] == generations
    assert window.caches[1].staged_count(3) == 5


def test_rounds_of_several_requests_replay_padded_request_counts(model: DiffusionLM) -> None:
    # A compact round's padding requests have no tokens in the linear products, so a round of 5
    # always replays the graph of 6 (fewer graphs); never past the caches there are, nor the
    # largest attention layout; a lone request has its own.
    window = _graphed(model, max_batch=8)
    graphs = window.graphs
    assert graphs is not None
    five = Bucket(2, 32, 0, requests=5, compact=256)
    for _ in range(40):
        assert graphs.choose(five) == replace(five, requests=6)
    wide = Bucket(8, 96, 0, requests=5, compact=512)
    assert wide.tokens <= MAX_LAYOUT_TOKENS < replace(wide, requests=6).tokens and graphs.choose(wide) == wide
    few = _graphed(model, max_batch=5).graphs
    assert few is not None and few.choose(five) == five
    assert graphs.choose(Bucket(4, 32, 0)) == Bucket(4, 32, 0)


def test_a_compact_round_runs_its_linear_products_on_its_real_tokens(model: DiffusionLM) -> None:
    # Requests of 1, 2 and 3 rows of different widths: attention pads each to 4 rows of the widest
    # window, the linear products run on the 3 requests' real tokens only (rounded up to 64).
    window = _graphed(model)
    batches = [round_batch(seed, seed, 0) for seed in (0, 1, 2)]
    real = sum(b.rows * b.width for b in batches)
    ran: list[int] = []
    hidden_states = model.hidden_states

    def counted(tokens: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        ran.append(tokens.shape[1])
        return hidden_states(tokens, *args, **kwargs)

    model.hidden_states = counted  # type: ignore[method-assign]
    try:
        window.forward_many(batches)
    finally:
        del model.hidden_states
    assert window.graphs is not None
    (bucket,) = window.graphs.graphs
    assert bucket.rows == 4 and bucket.tokens == 3 * 4 * 16 and real < 64 == bucket.compact
    assert ran == [64]


def test_the_concurrency_bench_reads_the_captures_of_a_graphed_window_model(model: DiffusionLM) -> None:
    graphed, plain = _graphed(model), WindowedLM(model, MAX_LENGTH, max_batch=4)
    probe = captures_of(graphed)
    assert probe is not None and probe() == (0, 0.0)
    graphed.forward_many([round_batch(s, s, 0) for s in (0, 1)])
    assert probe()[0] == 1 and captures_of(plain) is None


def test_a_lone_request_moves_to_physical_cache_0(model: DiffusionLM) -> None:
    graphed = _graphed(model)
    batch = round_batch(7, 3, 0)
    graphed.forward(batch)
    assert graphed.caches[3] is graphed._physical[0]
    assert graphed.caches[0] is graphed._physical[3]  # the sequence it displaced took its place


def test_a_reallocated_staging_area_drops_the_graphs_that_write_it(model: DiffusionLM) -> None:
    # A lone round's graph writes cache 0's staging; a batched round's does not.
    graphed = _graphed(model)
    batches = [round_batch(s, s, 0) for s in (0, 1)]
    graphed.forward(batches[0])
    graphed.caches[0].truncate(0)
    before = graphed.forward_many(batches)
    graphs = graphed.graphs
    assert graphs is not None and {b.requests for b in graphs.graphs} == {1, 2}
    lone, batched = (next(c for b, c in graphs.graphs.items() if b.requests == n) for n in (1, 2))
    graphed._physical[0].ensure_staging(40, 90)  # past what is reserved: the staging area moves
    for batch in batches:
        graphed.caches[batch.sequence].truncate(0)
    after = graphed.forward_many(batches)
    assert batched in graphs.graphs.values() and lone not in graphs.graphs.values()
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_a_graph_round_after_a_prompt_staged_in_the_cache(model: DiffusionLM) -> None:
    # An eager one-row forward wider than the staging stages into the cache (a prompt's first
    # round); a graphed round before any commit must stage into the slots and commit from them.
    graphed, plain = _graphed(model), WindowedLM(model, MAX_LENGTH, max_batch=4)
    plain.caches[0].ensure_staging(2, MAX_LENGTH)  # never stages in the cache: the reference
    generator = torch.Generator().manual_seed(11)
    prompt = WindowBatch(torch.randint(0, 90, (1, 70), generator=generator), [70],
                         torch.zeros(1, 70, dtype=torch.long), 0, 70, AttentionMode.FULL, outputs=(69,))
    WindowedLM._eager(graphed, prompt)  # what the graph path would not run: the eager forward
    plain._eager(prompt)
    assert graphed.caches[0].staging_capacity < 70 <= plain.caches[0].staging_capacity
    rows = WindowBatch(torch.randint(0, 90, (2, 20), generator=generator), [20, 17],
                       torch.ones(2, 20, dtype=torch.long), 0, 5, AttentionMode.FULL, outputs=(3, 25))
    torch.testing.assert_close(graphed.forward(rows), plain.forward(rows), rtol=1e-4, atol=1e-4)
    for window in (graphed, plain):
        window.commit(0, 5)
    torch.testing.assert_close(graphed.caches[0].cache[:, :, :5], plain.caches[0].cache[:, :, :5],
                               rtol=1e-4, atol=1e-4)


def test_a_failed_batched_capture_keeps_the_lone_graphs(model: DiffusionLM) -> None:
    window = WindowedLM(model, MAX_LENGTH, max_batch=4)
    graphs = window.graphs = WindowGraphs(model, window._physical, window.kv_storage, capture=False)
    window.forward_many([round_batch(s, s, 0) for s in (2, 3)])  # they stage in the round's buffer
    for sequence in (2, 3):
        window.caches[sequence].truncate(0)
    window.caches[3].stage_from(round_staging(graphs.round_kv, Bucket(1, 16, 0, 2, 64))[:, :, 1], 1, 2)
    capture = graphs._capture
    graphs._capture = lambda bucket: None if bucket.requests > 1 else capture(bucket)  # type: ignore[method-assign]
    graphs.graphs.clear()
    batches = [round_batch(s, s, 0) for s in (0, 1)]
    eager = WindowedLM(model, MAX_LENGTH, max_batch=4).forward_many(batches)
    for got, want in zip(window.forward_many(batches), eager, strict=True):
        assert torch.equal(got, want)  # the eager ragged forward, bit for bit
    assert graphs.batched_disabled and not graphs.disabled
    # A capture's warm-up writes the round's buffer even when the capture then fails: what cache 3
    # had staged there is forgotten, so a late commit of it fails.
    assert window.caches[3].staged_count(0) == 0
    window.forward(round_batch(5, 2, 0))
    assert [bucket.requests for bucket in graphs.graphs] == [1]


def _filled(model: DiffusionLM) -> tuple[WindowedLM, list[torch.Tensor]]:
    window = WindowedLM(model, MAX_LENGTH, max_batch=4)
    prefixes = []
    for sequence in range(4):
        kv = window.caches[sequence]
        n = 3 + 2 * sequence
        packed = torch.randn(kv.packed_shape(n), generator=torch.Generator().manual_seed(sequence))
        kv.append_packed(packed, n)
        prefixes.append(packed)
    return window, prefixes


def test_placement_moves_every_sequence_with_its_prefix(model: DiffusionLM) -> None:
    window, prefixes = _filled(model)
    physical = window._place_front([3, 1])
    assert physical is not None and sorted(physical) == [0, 1]
    assert sorted(map(id, window.caches)) == sorted(map(id, window._physical))  # still one cache each
    for sequence, prefix in enumerate(prefixes):
        kv = window.caches[sequence]
        assert kv.length == prefix.shape[2]
        assert torch.equal(kv.cache[:, :, : kv.length], prefix)


def test_a_move_discards_staged_kv_so_a_late_commit_fails_loudly(model: DiffusionLM) -> None:
    # What is staged when another round starts was never to be committed (a round commits before
    # the next one runs), e.g. a request that ended after its forward: it must not block a move,
    # and a commit after the move must not take the other cache's K/V.
    window, prefixes = _filled(model)
    window.caches[2].begin_stage(1, 2)
    assert window._place_front([2]) == [0]
    assert torch.equal(window.caches[2].cache[:, :, : window.caches[2].length], prefixes[2])
    with pytest.raises(ValueError, match="staged tokens"):
        window.commit(0, 2, sequence=2)


def test_forwards_are_counted_by_path(model: DiffusionLM) -> None:
    graphed, plain = _graphed(model), WindowedLM(model, MAX_LENGTH, max_batch=4)
    for window in (graphed, plain):
        window.forward_many([round_batch(s, s, 0) for s in (0, 1)])
        window.forward(round_batch(5, 2, 0))
    assert graphed.forwards == {"graph": 2, "eager": 0}
    assert plain.forwards == {"graph": 0, "eager": 2}
