"""The performance switches: how a model runs on its device, never what it answers.

Each is a key of the config file's `performance:` section (docs/lopa.yaml) with one environment
variable that overrides it, read here and nowhere else:

  cuda_graphs        LOPA_CUDA_GRAPHS        captured (1) | eager (0: no graphs) | uncaptured: the
                                             graphs' rounds, their bodies run eagerly (for profiles)
  cuda_graph_tokens  LOPA_CUDA_GRAPH_TOKENS  rounds of more linear tokens run eagerly; -1: all captured
  kernels            LOPA_KERNELS            triton | torch | interpret (Triton's interpreter, CPU)
  torch_compile      LOPA_TORCH_COMPILE      torch.compile the layers' steps on a GPU (1 / 0)
  fp8_products       LOPA_FP8_PRODUCTS       a JSON table of FP8 product kernels by shape ("": built in)

A worker installs its config's section before it loads the model (`install`); a process without
one (lopa generate, the benchmarks) runs on the defaults. The environment is read at each call, so
an override set before a model loads applies to it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

# Captured graphs replayed; eager forwards (no graphs); the graphs' rounds with their bodies run eagerly.
CAPTURED, EAGER, UNCAPTURED = "captured", "eager", "uncaptured"
GRAPH_MODES = (CAPTURED, EAGER, UNCAPTURED)
TRITON, TORCH, INTERPRET = "triton", "torch", "interpret"
KERNEL_MODES = (TRITON, TORCH, INTERPRET)

ENV = {
    "cuda_graphs": "LOPA_CUDA_GRAPHS",
    "cuda_graph_tokens": "LOPA_CUDA_GRAPH_TOKENS",
    "kernels": "LOPA_KERNELS",
    "torch_compile": "LOPA_TORCH_COMPILE",
    "fp8_products": "LOPA_FP8_PRODUCTS",
}


@dataclass(frozen=True)
class Switches:
    cuda_graphs: str = CAPTURED
    cuda_graph_tokens: int = -1
    kernels: str = TRITON
    torch_compile: bool = False
    fp8_products: str = ""

    def __post_init__(self) -> None:
        for key in KEYS:
            reason = _reason(key, getattr(self, key))
            if reason:
                raise ValueError(f"{key}: {reason}")


KEYS = tuple(ENV)  # every switch has its environment variable


def _reason(key: str, value: Any) -> str | None:
    """Why `value` cannot be the switch `key` (None: it can)."""
    if key == "cuda_graphs" and value not in GRAPH_MODES:
        return f"must be one of {', '.join(GRAPH_MODES)}, got {value!r}"
    if key == "cuda_graph_tokens" and value < -1:
        return f"must be >= 0 (-1: the default), got {value}"
    if key == "kernels" and value not in KERNEL_MODES:
        return f"must be one of {', '.join(KERNEL_MODES)}, got {value!r}"
    return None


_installed = Switches()


def install(switches: Switches) -> None:
    """This process's switches from now on (a worker's config section), under the environment's."""
    global _installed
    _installed = switches


def current(environ: Mapping[str, str] | None = None) -> Switches:
    """The installed switches with every environment override on top."""
    environ = os.environ if environ is None else environ
    overrides = {key: value(key, environ) for key in ENV if environ.get(ENV[key], "").strip()}
    return replace(_installed, **overrides) if overrides else _installed


def value(key: str, environ: Mapping[str, str] | None = None) -> Any:
    """One switch: its environment variable when set (ValueError naming the variable when it does not
    parse), else the installed value."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV[key], "").strip()
    if not text:
        return getattr(_installed, key)
    parsed = _parse(key, text)
    if parsed is None or _reason(key, parsed):
        raise ValueError(f"{ENV[key]}: {_EXPECTED[key]}, got {text!r}")
    return parsed


_EXPECTED = {
    "cuda_graphs": f"must be 1, 0 or one of {', '.join(GRAPH_MODES)}",
    "cuda_graph_tokens": "must be an integer >= 0 (linear tokens of the largest captured round)",
    "kernels": f"must be one of {', '.join(KERNEL_MODES)}",
    "torch_compile": "must be 1 or 0",
    "fp8_products": "must be a path",
}


def _parse(key: str, text: str) -> Any:
    """The variable's text as the key's value; None when it cannot be one."""
    if key == "cuda_graphs":
        return {"1": CAPTURED, "0": EAGER}.get(text, text)
    if key == "cuda_graph_tokens":
        return int(text) if text.isdigit() else None
    if key == "torch_compile":
        return {"1": True, "0": False}.get(text)
    return text
