"""A LoRA adapter merged at load time gives the same logits as PEFT applying it unmerged."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

from lopa.model import load_model
from lopa.synthetic import tiny_config, write_random_checkpoint, write_random_lora_adapter

PEFT_PREFIX = "base_model.model."


@pytest.mark.parametrize(
    ("targets", "use_rslora"),
    [(("q_proj", "k_proj", "v_proj", "o_proj"), False), (("q_proj", "v_proj", "down_proj"), True)],
)
def test_merged_equals_unmerged_peft(tmp_path: Path, targets: tuple[str, ...], use_rslora: bool) -> None:
    config = tiny_config()
    write_random_checkpoint(tmp_path / "base", config, seed=3)
    adapter = write_random_lora_adapter(
        tmp_path / "lora", config, r=4, alpha=16.0, targets=targets, seed=4, use_rslora=use_rslora
    )
    merged = load_model(tmp_path / "base", adapter_dir=tmp_path / "lora").model
    unmerged = load_model(tmp_path / "base").model

    lora_config = LoraConfig(r=4, lora_alpha=16.0, target_modules=list(targets), use_rslora=use_rslora)
    unmerged = inject_adapter_in_model(lora_config, unmerged)
    state = {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in adapter.items()}
    result = set_peft_model_state_dict(unmerged, state)
    assert not result.unexpected_keys

    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)
    with torch.no_grad():
        expected = unmerged(tokens, positions)
        got = merged(tokens, positions)
        plain = load_model(tmp_path / "base").model(tokens, positions)
    assert (expected - plain).abs().max() > 1e-3  # the adapter does change the outputs
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
