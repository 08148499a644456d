"""The CUDA path: bf16 against fp32 on the CPU, graphs against eager, CUDA against the CPU token for token;
the Triton kernels against their references (compiled), fused against unfused steps, FP8 weights
against bf16, the graph warm-up at start.

Needs a GPU: every test here skips cleanly without one (CI has none); run them on a GPU
machine (`pytest tests/runtime/test_cuda.py tests/serving/test_cuda_serving.py`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from round_cases import MAX_LENGTH, ROUNDS, play_rounds

from lopa.bundled import tasks
from lopa.decoding.decoder import Decoder
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.execution.local import LocalExecutor, OutputPlan
from lopa.model.decoding_defaults import model_defaults
from lopa.model.layer_steps import COMPILE_ENV
from lopa.model.loader import load_model
from lopa.model.window import GRAPH_TOKENS_ENV, GRAPHS_ENV, GRAPHS_UNCAPTURED, WindowedLM
from lopa.params import DecodingParams
from lopa.scheduling.alone import decode_alone
from lopa.scheduling.scheduler import Observer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = 12
# bf16 weights and activations against an fp32 reference: ||a - b|| / ||b|| of the logits. bf16 keeps
# 8 mantissa bits (~4e-3 per rounding); 2 layers of a random model accumulate a few of them.
BF16_REL_TOLERANCE = 3e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def greedy_outputs(executor: LocalExecutor, loaded, max_length: int, params_list) -> list[list[int]]:
    decoder = Decoder(executor, loaded.special.mask, loaded.special.eos, max_length)
    engine_ids = []
    for prompt, params in params_list:
        ids = list(loaded.tokenizer.encode(prompt, add_special_tokens=False))
        engine_ids.append(decode_alone(decoder, ids, params).generated_ids)
    return engine_ids


def test_bf16_cuda_forward_is_close_to_fp32_cpu(family_checkpoint: Path) -> None:
    cpu = load_model(family_checkpoint, dtype="float32", device="cpu")
    gpu = load_model(family_checkpoint, dtype="bfloat16", device="cuda")
    tokens = torch.randint(0, cpu.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(20)
    with torch.no_grad():
        want = cpu.model(tokens, positions).float()
        got = gpu.model(tokens.cuda(), positions.cuda()).float().cpu()
    error = relative_error(got, want)
    print(f"bf16 CUDA vs fp32 CPU logits: relative error {error:.2e}")
    assert torch.isfinite(got).all()
    assert error < BF16_REL_TOLERANCE


def _ragged_batch(executor: LocalExecutor, start: int, vocab: int, mask: int):
    from lopa.decoding.executor import BranchWindow

    generator = torch.Generator().manual_seed(5)
    windows = []
    for length in (24, 17, 9):
        tokens = torch.randint(0, vocab, (length,), generator=generator).tolist()
        tokens[-4:] = [mask] * 4
        blocks = [1] * (length // 2) + [2] * (length - length // 2)
        windows.append(BranchWindow(tokens, blocks, [start + length - 4 + i for i in range(4)]))
    plan = OutputPlan(start, 6, windows, executor.logit_shift)
    return executor.batch(start, 6, windows, plan.outputs)


@pytest.mark.parametrize("mode", ["full", "block_causal"])
def test_graph_replay_equals_eager_forward(family_checkpoint: Path, mode: str) -> None:
    loaded = load_model(family_checkpoint, dtype="float32", device="cuda")
    outputs = []
    for graphs in (True, False):
        window = WindowedLM(loaded.model, 128, cuda_graphs=graphs)
        executor = LocalExecutor(window, device="cuda")
        executor.begin(DecodingParams(attention=mode), 3)
        prefill = _ragged_batch(executor, 0, loaded.config.vocab_size, loaded.special.mask)
        window.forward(prefill)
        window.commit(1, 6)  # a cache of 6 tokens from row 1
        batch = _ragged_batch(executor, 6, loaded.config.vocab_size, loaded.special.mask)
        logits = window.forward(batch)
        staged = [window.kv.staged(slot, 1)[0].clone() for slot in range(3)]
        outputs.append((logits.cpu(), [s.cpu() for s in staged], window.graphs is not None))
    (graph_logits, graph_staged, used), (eager_logits, eager_staged, _) = outputs
    assert used, "the graph path was not taken"
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
    for got, want in zip(graph_staged, eager_staged, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _bundled_cases(limit: int):
    defaults = model_defaults(bundled_model_dir())
    examples = tasks.held_out(limit)
    cases = []
    for k in (0, 3):
        for mode in ("full", "block_causal"):
            params = defaults.with_overrides(branches=k, attention=mode)
            cases.extend((example.prompt, params) for example in examples)
    return cases


def test_bundled_greedy_fp32_is_token_identical_on_cuda_and_cpu() -> None:
    cases = _bundled_cases(PROMPTS)
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = LocalEngine.from_dirs(bundled_model_dir(), dtype="float32", device=device)
        executor = engine.decoder.executor
        assert isinstance(executor, LocalExecutor)
        if device == "cuda":
            assert engine.window_model.graphs is not None  # the graph path is what is checked
        outputs[device] = greedy_outputs(executor, engine.loaded, engine.max_length, cases)
    mismatches = [i for i, (a, b) in enumerate(zip(outputs["cpu"], outputs["cuda"], strict=True)) if a != b]
    print(f"bundled model, fp32: {len(cases) - len(mismatches)}/{len(cases)} decodes token-identical")
    assert not mismatches, [cases[i][1] for i in mismatches]


def test_bundled_greedy_graphs_equal_eager_on_cuda() -> None:
    cases = _bundled_cases(PROMPTS // 2)
    outputs = []
    for graphs in (True, False):
        loaded = load_model(bundled_model_dir(), dtype="float32", device="cuda")
        window = loaded.window_model(256, cuda_graphs=graphs)
        outputs.append(greedy_outputs(LocalExecutor(window, device="cuda", pad_id=loaded.special.pad), loaded,
                                      256, cases))
    assert outputs[0] == outputs[1]


def test_graphs_survive_a_staging_reallocation(family_checkpoint: Path) -> None:
    # Growing the staging area drops every graph (they hold its address) and releases their memory
    # pool; the next forwards must capture into a new pool and still match.
    loaded = load_model(family_checkpoint, dtype="float32", device="cuda")
    window = WindowedLM(loaded.model, 512)
    executor = LocalExecutor(window, device="cuda")
    executor.begin(DecodingParams(), 3)
    batch = _ragged_batch(executor, 0, loaded.config.vocab_size, loaded.special.mask)
    before = window.forward(batch).cpu()
    assert window.graphs is not None and len(window.graphs.graphs) == 1
    window.kv.ensure_staging(40, 300)  # past the reservation: the staging area moves
    after = window.forward(batch).cpu()
    assert not window.graphs.disabled and len(window.graphs.graphs) == 1
    torch.testing.assert_close(after, before)


def test_batched_rounds_replay_graphs_and_equal_eager_rounds() -> None:
    # Rounds of 1-4 requests joining and leaving (tests/runtime/test_model_round_graphs.py runs the
    # same rounds through the uncaptured body on the CPU): captured and replayed here.
    loaded = load_model(bundled_model_dir(), dtype="float32", device="cuda")
    graphed = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4)
    eager = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4, cuda_graphs=False)

    def no_eager(*args: object) -> None:
        raise AssertionError("an eager forward where a graph replay was expected")

    graphed._eager = no_eager  # type: ignore[method-assign]
    graphed._eager_many = no_eager  # type: ignore[method-assign]
    play_rounds(eager, graphed, ROUNDS)
    assert graphed.graphs is not None and not graphed.graphs.disabled
    assert {bucket.requests for bucket in graphed.graphs.graphs} == {1, 2, 3, 4}


def test_rounds_replay_the_graph_of_a_padded_request_count() -> None:
    # 5 requests replay the captured graph of 6, its padding request over a cache that holds another
    # sequence's prefix, read by the last round (the CPU runs the same rounds uncaptured in
    # tests/runtime/test_model_round_graphs.py).
    loaded = load_model(bundled_model_dir(), dtype="float32", device="cuda")
    graphed = WindowedLM(loaded.model, MAX_LENGTH, max_batch=8)
    eager = WindowedLM(loaded.model, MAX_LENGTH, max_batch=8, cuda_graphs=False)
    play_rounds(eager, graphed, [[5, 6], [0, 1, 2, 3, 4], [4, 2, 0, 1, 3], [5, 6, 0]])
    assert graphed.graphs is not None and not graphed.graphs.disabled
    assert {bucket.requests for bucket in graphed.graphs.graphs} == {2, 6, 3}
    assert graphed.forwards == {"graph": 4, "eager": 0}


def test_uncaptured_graph_rounds_run_the_same_rounds_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    # LOPA_CUDA_GRAPHS=uncaptured (for profiling: every kernel then belongs to an op) takes the
    # graphs' path, buckets and compact layout, without capturing.
    monkeypatch.setenv(GRAPHS_ENV, GRAPHS_UNCAPTURED)
    loaded = load_model(bundled_model_dir(), dtype="float32", device="cuda")
    uncaptured = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4)
    eager = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4, cuda_graphs=False)
    play_rounds(eager, uncaptured, ROUNDS)
    assert uncaptured.graphs is not None and not uncaptured.graphs.capture
    assert uncaptured.forwards["eager"] == 0 and uncaptured.graphs.graphs


def test_rounds_past_the_capture_limit_run_uncaptured(monkeypatch: pytest.MonkeyPatch) -> None:
    # LOPA_CUDA_GRAPH_TOKENS=64: buckets of more linear tokens run their body eagerly (no graph, no
    # capture counted), smaller ones replay captured graphs; every round equals the eager model's.
    monkeypatch.setenv(GRAPH_TOKENS_ENV, "64")
    loaded = load_model(bundled_model_dir(), dtype="float32", device="cuda")
    hybrid = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4)
    eager = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4, cuda_graphs=False)
    play_rounds(eager, hybrid, ROUNDS)
    assert hybrid.graphs is not None and not hybrid.graphs.disabled
    graphs = hybrid.graphs.graphs
    captured = [b for b, c in graphs.items() if c.graph is not None]
    assert captured and all(b.linear_tokens <= 64 for b in captured)
    assert any(c.graph is None and b.linear_tokens > 64 for b, c in graphs.items())
    assert hybrid.graph_captures()[0] == len(captured) and hybrid.forwards["eager"] == 0


def test_compiled_layer_steps_replay_in_graphs_and_equal_eager_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # LOPA_TORCH_COMPILE=1: the layers' elementwise steps compiled by inductor (triton kernels),
    # captured inside the rounds' graphs; rounds of 1-4 requests equal the eager model's.
    torch._dynamo.reset()
    monkeypatch.setenv(COMPILE_ENV, "1")
    compiled = load_model(bundled_model_dir(), dtype="float32", device="cuda")
    window = WindowedLM(compiled.model, MAX_LENGTH, max_batch=4)
    assert compiled.model.steps.compiled
    monkeypatch.delenv(COMPILE_ENV)
    plain = load_model(bundled_model_dir(), dtype="float32", device="cuda")
    eager = WindowedLM(plain.model, MAX_LENGTH, max_batch=4, cuda_graphs=False)
    try:
        play_rounds(eager, window, ROUNDS)
        assert window.graphs is not None and not window.graphs.disabled and window.forwards["eager"] == 0
        # Inductor compiled the three steps (at start), recompiling a few times at most.
        assert 3 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 8
    finally:
        torch._dynamo.reset()


class _BatchSizes(Observer):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def round(self, batch: int, granted, wanted) -> None:
        self.sizes.append(batch)


def batched_equals_alone(device: str, requests: int = 8) -> tuple[list[int], int]:
    """Greedy outputs of `requests` concurrent requests (ragged forwards, every branch granted)
    against each run alone on the same engine: the indices that differ, and the largest batch."""
    engine = LocalEngine.from_dirs(bundled_model_dir(), dtype="float32", device=device, max_batch=requests,
                                   max_step_tokens=1 << 20)
    sizes = _BatchSizes()
    engine.scheduler.observer = sizes
    defaults = model_defaults(bundled_model_dir())
    modes = ("full", "block_causal")
    cases = [
        (example.prompt, defaults.with_overrides(branches=index % 4, attention=modes[index % 2]))
        for index, example in enumerate(tasks.held_out(requests))
    ]
    try:
        alone = [engine.generate(prompt, params).result.output_ids for prompt, params in cases]
        with ThreadPoolExecutor(requests) as pool:
            together = list(pool.map(lambda case: engine.generate(*case).result.output_ids, cases))
    finally:
        engine.close()
    return [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a != b], max(sizes.sizes)


def test_batched_rounds_on_cuda_equal_each_request_alone() -> None:
    # Accelerators do not promise batch invariance (lopa.model.invariant is CPU-only), but in fp32
    # the bundled model's greedy tokens do not sit on near-ties (CUDA and CPU agree token for token
    # above), so 8 requests decoded in ragged CUDA forwards must give what each gives alone.
    mismatches, largest = batched_equals_alone("cuda")
    assert largest >= 4, "the requests never shared a forward"
    assert not mismatches


# -- the kernels (lopa.kernels), FP8 weights, the graph warm-up -------------------------------------------


def _kernel_cases(dtype: torch.dtype) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda").to(dtype)

    return {"x": draw(1, 37, 3584), "delta": draw(1, 37, 3584), "weight": 1 + draw(3584) / 4,
            "gate_up": draw(1, 37, 2 * 4736), "qkv": draw(1, 37, 36, 128), "hidden": draw(37, 3584)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_equal_their_references_on_cuda(dtype: torch.dtype) -> None:
    from lopa.kernels import fp8, fp8_linear, rms_norm, rotary, swiglu, vocab_stats
    from lopa.kernels.fp8_products import scaled_mm_linear
    from lopa.model.transformer import rotary_cos_sin, signed_sin
    from lopa.params import ConfKind

    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    case = _kernel_cases(dtype)
    for got, want in zip(rms_norm.add_rms_norm(case["x"], case["delta"], case["weight"], 1e-6),
                         rms_norm.add_rms_norm_reference(case["x"], case["delta"], case["weight"], 1e-6),
                         strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    gate, up = case["gate_up"].chunk(2, dim=-1)
    torch.testing.assert_close(swiglu.swiglu(gate, up), swiglu.swiglu_reference(gate, up), **tolerance)
    cos, sin = rotary_cos_sin(torch.arange(37, device="cuda").view(1, 37) + 100, 128, 1e6, dtype)
    staged = [torch.zeros(64, 4, 128, dtype=dtype, device="cuda") for _ in range(4)]
    rows = torch.randperm(64, device="cuda")[:37]
    got = rotary.rotary_qkv(case["qkv"], cos, signed_sin(sin), 28, 4, (staged[0], staged[1], rows))
    want = rotary.rotary_qkv_reference(case["qkv"], cos, signed_sin(sin), 28, 4, (staged[2], staged[3], rows))
    for one, other in zip([*got, staged[0], staged[1]], [*want, staged[2], staged[3]], strict=True):
        torch.testing.assert_close(one, other, **tolerance)
    for n, k in ((4608, 3584), (3584, 18944)):  # qkv, and down (split-K)
        x = case["hidden"][:, :k] if k == 3584 else torch.randn(37, k, device="cuda").to(dtype)
        values, scale = fp8.quantize(torch.randn(n, k, device="cuda") / k**0.5)
        want = fp8.linear_reference(x.float(), values, scale)
        for product in (fp8_linear.fp8_linear, scaled_mm_linear):
            if product is scaled_mm_linear and dtype == torch.float32:
                continue
            got = product(x, values, scale).float()
            assert float((got - want).norm() / want.norm()) < (0.05 if product is scaled_mm_linear else 1e-2)
    head = torch.randn(4096, 3584, device="cuda").to(dtype) / 30
    for kind in ConfKind:
        got = vocab_stats.greedy_stats(case["hidden"], head, None, kind)
        want = vocab_stats.greedy_stats_reference(case["hidden"], head, None, kind)
        assert (got[0] == want[0]).float().mean() >= 0.9
        torch.testing.assert_close(got[1], want[1], rtol=0.05, atol=0.02)
        torch.testing.assert_close(got[2], want[2], rtol=0.05, atol=0.05)


def test_rounds_on_the_kernels_equal_rounds_on_the_references_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fused against unfused: the Triton steps (default on a GPU) and LOPA_KERNELS=torch, both
    replaying graphs, over rounds of 1-4 requests."""
    from lopa.kernels.dispatch import KERNELS_ENV

    fused = WindowedLM(load_model(bundled_model_dir(), dtype="float32", device="cuda").model,
                             MAX_LENGTH, max_batch=4)
    assert fused.model.steps.kernels and fused.vocab_pass
    monkeypatch.setenv(KERNELS_ENV, "torch")
    plain = WindowedLM(load_model(bundled_model_dir(), dtype="float32", device="cuda").model,
                             MAX_LENGTH, max_batch=4)
    assert not plain.model.steps.kernels and not plain.vocab_pass
    play_rounds(plain, fused, ROUNDS)
    assert fused.graphs is not None and not fused.graphs.disabled and fused.forwards["eager"] == 0


def test_greedy_decodes_through_the_vocabulary_pass_as_through_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lopa.kernels.dispatch import KERNELS_ENV

    cases = _bundled_cases(PROMPTS // 2)
    outputs = []
    for mode in ("triton", "torch"):
        monkeypatch.setenv(KERNELS_ENV, mode)
        loaded = load_model(bundled_model_dir(), dtype="float32", device="cuda")
        window = loaded.window_model(256)
        assert window.vocab_pass == (mode == "triton")
        outputs.append(greedy_outputs(LocalExecutor(window, device="cuda", pad_id=loaded.special.pad), loaded,
                                      256, cases))
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    print(f"vocabulary pass against logits, fp32: {same}/{len(cases)} decodes token-identical")
    assert same == len(cases)


def _fp8_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def test_fp8_weights_are_refused_below_compute_capability_8_9_and_close_to_bf16_above(
    family_checkpoint: Path,
) -> None:
    if not _fp8_supported():
        with pytest.raises(ValueError, match=r"weights: fp8 weights need a GPU of compute capability 8\.9"):
            load_model(family_checkpoint, dtype="bfloat16", device="cuda", weights="fp8")
        return
    plain = load_model(family_checkpoint, dtype="bfloat16", device="cuda")
    quantized = load_model(family_checkpoint, dtype="bfloat16", device="cuda", weights="fp8")
    tokens = torch.randint(0, plain.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40, device="cuda")
    with torch.no_grad():
        want = plain.model(tokens.cuda(), positions).float()
        got = quantized.model(tokens.cuda(), positions).float()
        on_cpu = load_model(family_checkpoint, dtype="bfloat16", weights="fp8")  # the reference path
        reference = on_cpu.model(tokens, positions.cpu())
    error = relative_error(got.cpu(), want.cpu())
    print(f"fp8 vs bf16 logits on CUDA: relative error {error:.3f}; "
          f"against the CPU's fp8 reference {relative_error(got.cpu(), reference.float()):.3f}")
    assert error < 0.1 and relative_error(got.cpu(), reference.float()) < BF16_REL_TOLERANCE


@pytest.mark.skipif(not _fp8_supported(), reason="needs FP8 (compute capability 8.9)")
def test_fp8_rounds_replay_graphs_and_equal_eager_rounds() -> None:
    loaded = load_model(bundled_model_dir(), dtype="float32", device="cuda", weights="fp8")
    graphed = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4)
    eager = WindowedLM(loaded.model, MAX_LENGTH, max_batch=4, cuda_graphs=False)
    play_rounds(eager, graphed, ROUNDS)
    assert graphed.graphs is not None and not graphed.graphs.disabled and graphed.forwards["eager"] == 0


@pytest.mark.skipif(not _fp8_supported(), reason="needs FP8 (compute capability 8.9)")
def test_bundled_fp8_weights_keep_exact_match_on_cuda() -> None:
    from lopa_bench.weights import agreement, decode_all

    examples = tasks.held_out(PROMPTS * 2)
    params = model_defaults(bundled_model_dir()).with_overrides(branches=7)
    decoded = {}
    for weights in ("dtype", "fp8"):
        engine = LocalEngine.from_dirs(bundled_model_dir(), dtype="bfloat16", device="cuda", max_batch=1,
                                       weights=weights)
        try:
            decoded[weights] = decode_all(engine, examples, params)
        finally:
            engine.close()
    plain, fp8 = decoded["dtype"], decoded["fp8"]
    print(f"bundled k=7 bf16 -> fp8 on CUDA: exact match {plain.exact_match:.3f} -> {fp8.exact_match:.3f}, "
          f"greedy agreement {agreement(plain, fp8):.3f}")
    assert 100 * fp8.exact_match >= 100 * plain.exact_match - 1.0


def test_a_fresh_engine_captures_its_likely_graphs_before_the_first_request() -> None:
    """Graphs vs eager at start: the warm-up captured buckets before any request, and a batch of
    requests at the defaults then captures few more (lopa.scheduling.warmup)."""
    params = model_defaults(bundled_model_dir()).with_overrides(branches=3)
    engine = LocalEngine.from_dirs(bundled_model_dir(), dtype="float32", device="cuda", max_batch=4,
                                   warm=params)
    try:
        at_start = engine.window_model.graph_captures()[0]
        assert at_start > 0
        prompts = [example.prompt for example in tasks.held_out(8)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda prompt: engine.generate(prompt, params), prompts))
        later = engine.window_model.graph_captures()[0] - at_start
        print(f"captured {at_start} graphs at start, {later} while serving 8 requests 4 at a time")
    finally:
        engine.close()
