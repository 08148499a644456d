"""What one server (or local engine) accepts and holds at once: the config file's `limits:` section,
whose defaults `lopa serve`, the workers and `lopa generate` share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_branches: int = 15
    max_new_tokens: int = 1024
    max_prompt_tokens: int = 2048
    queue_size: int = 64
    request_timeout_s: float = 300.0
    max_batch: int = 8  # requests decoding at once: one KV cache each on every worker, allocated at start
    max_step_tokens: int = 0  # tokens of one forward per worker (branch budget); 0 = the device's default
    # prompt + answer of a request at most (its KV cache); 0 = max_prompt_tokens + max_new_tokens
    max_model_len: int = 0

    @property
    def max_length(self) -> int:
        """KV cache length of every request (before capping by the model's position limit)."""
        total = self.max_prompt_tokens + self.max_new_tokens
        return min(total, self.max_model_len) if self.max_model_len else total
