"""The training loop of the bundled model: seeded, CPU, progress on stderr, checkpoints on disk."""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from lopa.bundled import tasks
from lopa.bundled.chat import CHAT_TEMPLATE
from lopa.model.transformer import DiffusionLM
from lopa.training.checkpoint import save_checkpoint
from lopa.training.config import TrainConfig, model_config
from lopa.training.data import make_batch
from lopa.training.objective import diffusion_loss

INIT_STD = 0.02


def init_weights(model: DiffusionLM, generator: torch.Generator) -> None:
    """Qwen2-style init (normal 0.02, zero biases, unit norms), drawn from our own generator."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(
    config: TrainConfig,
    out: str | Path,
    log: TextIO | None = None,
    on_save: Callable[[Path, int], None] | None = None,
) -> dict[str, Any]:
    """Train from scratch and write the checkpoint to `out`; returns the run summary."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _train(config, out, log or sys.stderr, on_save)
    finally:
        torch.set_num_threads(threads)  # the thread count is process-wide: give it back


def _train(
    config: TrainConfig,
    out: str | Path,
    log: TextIO,
    on_save: Callable[[Path, int], None] | None,
) -> dict[str, Any]:
    # long: the training loop; its state is the loop's locals
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    model = DiffusionLM(model_config(config))
    init_weights(model, generator)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.98),
    )
    # Train on the written answers: each group in a randomly chosen valid form.
    pairs = tasks.training_pairs("train", config.seed)
    stream = (replace(example, answer=written) for example, written in pairs)
    began = time.perf_counter()
    recent: list[float] = []
    step = 0
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        batch = make_batch(
            list(itertools.islice(stream, config.batch_size)), config.block_size, config.gen_blocks
        )
        loss = diffusion_loss(model, batch, config.gen_blocks, config.full_attention_fraction, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent.append(loss.item())
        elapsed = time.perf_counter() - began
        done = step + 1
        if done % config.log_every == 0 or done == config.steps:
            eta = elapsed / done * (config.steps - done)
            mean = sum(recent) / len(recent)
            print(
                f"step {done}/{config.steps} loss {mean:.4f} lr {learning_rate(config, step):.2e} "
                f"elapsed {elapsed:.0f}s eta {eta:.0f}s",
                file=log,
                flush=True,
            )
            recent = []
        out_of_time = config.max_minutes > 0 and elapsed > config.max_minutes * 60
        if (config.save_every and done % config.save_every == 0) or out_of_time:
            _save(model, out, config, done, elapsed, on_save)
        if out_of_time:
            print(f"stopping after {done} steps: --max-minutes {config.max_minutes} reached", file=log)
            break
    summary = _save(model, out, config, step + 1, time.perf_counter() - began, on_save)
    print(f"wrote {out} ({summary['steps_done']} steps, {summary['train_seconds']:.0f}s)", file=log)
    return summary


def _save(
    model: DiffusionLM,
    out: str | Path,
    config: TrainConfig,
    steps_done: int,
    elapsed: float,
    on_save: Callable[[Path, int], None] | None,
) -> dict[str, Any]:
    summary = {
        "recipe": config.to_dict(),
        "steps_done": steps_done,
        "train_seconds": round(elapsed, 1),
        "torch": torch.__version__,
    }
    model.eval()
    path = save_checkpoint(model, out, summary, CHAT_TEMPLATE)  # the bundled model's (lopa.bundled.chat)
    model.train()
    if on_save is not None:
        on_save(path, steps_done)
    return summary
