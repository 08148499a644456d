"""The training recipe keeps working: a few steps on a tiny config write a loadable checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lopa.bundled import tasks
from lopa.cli import main
from lopa.engine import LocalEngine
from lopa.model import load_model
from lopa.params import DecodingParams
from lopa.training.data import MASK, make_batch
from lopa.training.objective import attention_mask, block_ratios, diffusion_loss, noise

TINY = [
    "--hidden-size",
    "32",
    "--intermediate-size",
    "64",
    "--layers",
    "1",
    "--heads",
    "2",
    "--kv-heads",
    "1",
]


def test_train_bundled_writes_a_loadable_checkpoint(tmp_path: Path, capsys) -> None:
    out = tmp_path / "model"
    args = ["train-bundled", "--out", str(out), "--steps", "3", "--batch-size", "4", "--log-every", "1"]
    assert main([*args, *TINY, "--seed", "7"]) == 0
    err = capsys.readouterr().err
    assert "step 3/3 loss" in err and "eta" in err and "elapsed" in err
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training.json",
    ):
        assert (out / name).is_file(), name
    loaded = load_model(out)
    assert loaded.config.hidden_size == 32 and loaded.special.mask == MASK
    assert json.loads((out / "training.json").read_text())["steps_done"] == 3
    completion = LocalEngine(loaded).generate(
        tasks.held_out(1)[0].prompt, DecodingParams(block_size=8, max_new_tokens=16)
    )
    assert completion.result.forwards >= 1


def test_train_bundled_writes_a_llada_checkpoint_whose_loss_reads_own_position_logits(tmp_path: Path) -> None:
    out = tmp_path / "llada"
    args = ["train-bundled", "--out", str(out), "--steps", "2", "--batch-size", "4", "--family", "llada"]
    assert main([*args, *TINY]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "llada" and raw["d_model"] == 32 and not raw["include_qkv_bias"]
    loaded = load_model(out)
    assert loaded.config.family == "llada" and loaded.config.logit_shift == 0
    assert json.loads((out / "training.json").read_text())["recipe"]["family"] == "llada"
    # The objective reads each masked position's own output (no shift): cross-entropy at p for token p.
    batch = make_batch(tasks.held_out(8), block_size=8, gen_blocks=4)
    generator = torch.Generator().manual_seed(1)
    noisy, masked = noise(batch, 4, generator)
    full_rows = torch.rand(noisy.shape[0], generator=generator) < 0.5
    with torch.no_grad():
        logits = loaded.model(noisy, torch.arange(noisy.shape[1]), attention_mask(batch.block_ids, full_rows))
        expected = torch.nn.functional.cross_entropy(logits[masked].float(), batch.tokens[masked])
        got = diffusion_loss(loaded.model, batch, 4, 0.5, torch.Generator().manual_seed(1))
    torch.testing.assert_close(got, expected)


def test_training_is_deterministic(tmp_path: Path) -> None:
    weights = []
    for run in ("a", "b"):
        out = tmp_path / run
        main(["train-bundled", "--out", str(out), "--steps", "2", "--batch-size", "4", *TINY])
        weights.append(load_model(out).model.lm_head.weight)
    assert torch.equal(weights[0], weights[1])


def test_later_blocks_are_noisier_and_masks_only_touch_the_answer() -> None:
    generator = torch.Generator().manual_seed(0)
    ratios = block_ratios(500, 4, generator)
    assert bool((ratios[:, 1:] >= ratios[:, :-1]).all())
    assert bool((ratios == 0).any()) and bool((ratios == 1).any())
    batch = make_batch(tasks.held_out(6), block_size=8, gen_blocks=4)
    noisy, masked = noise(batch, 4, generator)
    assert bool(masked.any(dim=1).all())
    assert not bool((masked & (batch.block_ids <= 0)).any())  # prompt and padding never masked
    assert bool((noisy[masked] == MASK).all())


def test_block_causal_and_full_attention_rows() -> None:
    block_ids = torch.tensor([[0, 0, 1, 1, 2, 2, -1], [0, 0, 1, 1, 2, 2, -1]])
    mask = attention_mask(block_ids, torch.tensor([False, True]))[:, 0]
    causal, full = mask[0], mask[1]
    assert causal[1, :2].all() and not causal[1, 2:].any()  # prompt sees prompt only
    assert causal[3, :4].all() and not causal[3, 4:].any()  # block 1 sees prompt + block 1
    assert full[1, :6].all() and not full[1, 6]  # full: everything but padding
    assert mask[:, 6, 6].all()  # padding queries see themselves (no empty softmax row)
