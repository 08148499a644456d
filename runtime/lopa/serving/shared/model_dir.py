"""The model a serving role loads: its directory (the configured path, else the bundled model), the
config file completed from it, and the KV cache length it allows (no torch: the master reads it)."""

from __future__ import annotations

from pathlib import Path

from lopa.bundled import bundled_model_dir
from lopa.model.config import CONFIG_FILE, ModelConfig
from lopa.params import decoded_tokens
from lopa.serving.shared.config import ConfigError, ServingConfig, load_config, validate, with_model_defaults


def model_path(configured: str) -> Path:
    path = Path(configured) if configured else bundled_model_dir()
    if not (path / "config.json").is_file():
        what = f"model.path {configured!r}" if configured else f"the bundled model ({path})"
        raise ConfigError(f"{what} has no config.json")
    return path


def usable_max_length(config: ServingConfig, path: Path) -> int:
    """The KV cache length of every role: the limits' prompt + answer, capped by the model's
    max_position_embeddings. ConfigError naming the key when the decoding defaults cannot fit in it
    (every request that does not set its own max_new_tokens would fail)."""
    positions = ModelConfig.from_dir(path).max_position_embeddings
    max_length = min(config.max_length, positions)
    new = config.decoding.max_new_tokens
    if decoded_tokens(new, config.decoding.block_size) + 1 > max_length:  # a prompt has a token at least
        raise ConfigError(
            f"decoding.max_new_tokens: {new} leaves no room for a prompt in the model's length {max_length} "
            f"(max_position_embeddings {positions} in {path / CONFIG_FILE}, limits.max_prompt_tokens + "
            f"limits.max_new_tokens = {config.max_length}); at most {max_length - 1}"
        )
    return max_length


def role_config(path: str) -> ServingConfig:
    """The config file of a master or worker: the decoding keys it leaves out come from the model's
    own defaults (both roles read the same file the same way), validated, and checked against the
    model's length."""
    config = load_config(path)
    directory = model_path(config.model.path)
    config = with_model_defaults(config, directory)
    try:
        validate(config)
        usable_max_length(config, directory)
    except ConfigError as error:  # the model's defaults may be what does not fit
        raise ConfigError(f"{path}: {error} (decoding keys not in the file come from the model)") from None
    return config
