"""The model directory a role loads and the KV caches it allows (lopa.serving.shared.model_dir)."""

from __future__ import annotations

import pytest
import torch

from lopa.serving.shared.config import ConfigError, parse_config
from lopa.serving.shared.model_dir import check_kv_fits, kv_cache_bytes
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
