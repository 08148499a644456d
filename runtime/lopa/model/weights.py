"""Reading and validating a checkpoint's safetensors: one file or shards with an index json."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lopa.model.errors import CheckpointError
from lopa.model.families import Family
from lopa.model.families.dream import FAMILY as DREAM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ROTARY_BUFFER = "rotary_emb.inv_freq"


def tensor_files(model_dir: str | Path) -> tuple[dict[str, Path], Path]:
    """Map each tensor name to the file holding it, plus the file that told us (index or single file)."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return _read_index(index_path), index_path
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(single, f"file not found (nor {INDEX_FILE})")
    with _open(single) as handle:
        return dict.fromkeys(handle.keys(), single), single


def _read_index(index_path: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(index_path, f"not a safetensors index (needs 'weight_map'): {exc}") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index_path, "'weight_map' must map tensor names to shard files")
    files: dict[str, Path] = {}
    for name, shard in weight_map.items():
        path = index_path.parent / str(shard)
        if not path.is_file():
            raise CheckpointError(path, f"shard listed in {index_path.name} (for tensor {name}) not found")
        files[name] = path
    return files


def _open(path: Path) -> Any:  # safetensors' handle type is private
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(path, f"not a readable safetensors file: {exc}") from None


def load_tensors(
    model_dir: str | Path,
    expected: Mapping[str, torch.Size],
    device: torch.device,
    dtype: torch.dtype,
    optional: frozenset[str] = frozenset(),
    family: Family = DREAM,
) -> dict[str, torch.Tensor]:
    """Load exactly the `expected` tensors (lopa's names -> shapes), cast to dtype on device, keyed
    by lopa's names; the files name them as `family` does.

    Every expected tensor must be present with its shape, and nothing else may be (names in
    `optional`, such as a tied lm_head, may be absent); errors name the file and the tensor as the
    file spells it.
    """
    files, source = tensor_files(model_dir)
    # Rotary frequencies are recomputed, never loaded; some exports still carry them.
    files = {name: path for name, path in files.items() if not name.endswith(_ROTARY_BUFFER)}
    ours: dict[str, str] = {}  # the file's name -> lopa's
    for name, path in files.items():
        lopa_name = family.lopa_name(name)
        if lopa_name is None or lopa_name not in expected:
            raise CheckpointError(
                path, f"unexpected tensor {name} (not a parameter of the {family.name} model)"
            )
        ours[name] = lopa_name
    present = set(ours.values())
    for name in expected:
        if name not in present and name not in optional:
            raise CheckpointError(source, f"missing tensor {family.checkpoint_name(name)}")
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with _open(path) as handle:
            in_file = set(handle.keys())
            for name in names:
                if name not in in_file:
                    raise CheckpointError(path, f"missing tensor {name} (the index says it is in this shard)")
                shape, wanted = torch.Size(handle.get_slice(name).get_shape()), expected[ours[name]]
                if shape != wanted:
                    raise CheckpointError(
                        path, f"tensor {name} has shape {tuple(shape)}, expected {tuple(wanted)}"
                    )
                tensor = handle.get_tensor(name).to(device=device, dtype=dtype)
                check_finite(tensor, name, path)
                tensors[ours[name]] = tensor
    return tensors


def check_finite(tensor: torch.Tensor, name: str, path: Path) -> None:
    """A NaN or inf weight makes every answer garbage while the model looks healthy: refuse it at
    load (one reduction per tensor, on the device it was loaded to)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(path, f"tensor {name} has non-finite values (NaN or inf)")
