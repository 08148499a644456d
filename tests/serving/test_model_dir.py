"""The model directory a role loads and the KV caches it allows (lopa.serving.shared.model_dir)."""

from __future__ import annotations

import pytest
import torch

from lopa.serving.shared.config import ConfigError, parse_config
from lopa.serving.worker.kv_memory import check_kv_fits, kv_cache_bytes
from lopa.synthetic import tiny_config


def test_kv_caches_that_cannot_fit_fail_at_start_naming_max_batch() -> None:
    model = tiny_config()
    config = parse_config({"limits": {"max_batch": 256}})
    huge = 1 << 34  # tokens per cache: no machine has that much memory for 256 of them
    with pytest.raises(ConfigError, match=r"^limits\.max_batch: 256 KV caches of 17179869184 tokens need "):
        check_kv_fits(config, model, huge, torch.device("cpu"), element_size=4)
    fits = check_kv_fits(config, model, 64, torch.device("cpu"), element_size=4)
    assert fits == kv_cache_bytes(model, 64, 256, 4) == 256 * 64 * model.num_hidden_layers * 2 * (
        model.num_key_value_heads * model.head_dim * 4)


def test_the_fit_check_counts_the_staging_a_graphed_window_model_reserves() -> None:
    # Graphs are CUDA-only; their reservation is applied by hand to a CPU window model here, so
    # the formula the check uses is compared with the bytes the caches really allocate.
    from lopa.model import WindowedLM
    from lopa.model.cuda_graphs import WindowGraphs
    from lopa.model.graph_layout import MAX_LAYOUT_TOKENS
    from lopa.model.window import graph_staging, reserved_staging_tokens
    from lopa.synthetic.checkpoint import random_model

    model = random_model(tiny_config(max_position_embeddings=256), torch.float32, "cpu")
    window = WindowedLM(model, 200, max_batch=3)
    for index, kv in enumerate(window._physical):
        kv.ensure_staging(*graph_staging(index, 1, 200))
    window.graphs = WindowGraphs(model, window._physical, window.kv_storage, capture=False)
    staging = reserved_staging_tokens(3, 1, 200, graphs=True)
    # cache 0's capped at the length, and the batched rounds' buffer
    assert staging == 16 * 200 + MAX_LAYOUT_TOKENS
    assert window.reserved_bytes() == kv_cache_bytes(model.config, 200, 3, 4, staging)
    assert reserved_staging_tokens(3, 1, 200, graphs=False) == 0

