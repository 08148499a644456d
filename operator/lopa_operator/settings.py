"""The operator's process settings: read once from its flags and their environment overrides,
installed before the handlers are registered, and read here by every module that needs one.

Each setting has one documented environment override (the chart sets some), read in
`from_environment` and nowhere else; a flag given on the command line wins over it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

# The environment override of each setting.
ENV = {
    "metrics_port": "LOPA_OPERATOR_METRICS_PORT",
    "resync_s": "LOPA_OPERATOR_RESYNC_SECONDS",
    "retry_backoff_s": "LOPA_OPERATOR_RETRY_BACKOFF",
    "retry_refused_s": "LOPA_OPERATOR_RETRY_REFUSED_SECONDS",
    "watch_server_timeout_s": "LOPA_OPERATOR_WATCH_SERVER_TIMEOUT",
    "workers": "LOPA_OPERATOR_WORKERS",
}


@dataclass(frozen=True)
class Settings:
    metrics_port: int = 9090  # Prometheus /metrics (0: none)
    resync_s: float = 10.0  # between resyncs of every LoPADeployment (status re-derived, losses noticed)
    retry_backoff_s: float = 5.0  # before a failed handler runs again
    # before a refused rendering (a child the API server refused, a missing InferencePool CRD) is
    # tried again; a new rendering (an edit) is tried at once
    retry_refused_s: float = 60.0
    watch_server_timeout_s: int = 300  # bounds every watch request (whole seconds: the API server's)
    workers: int = 8  # kopf's handler threads

    def with_flags(self, **given: Any) -> Settings:
        """These settings with the flags the command line gave (None: not given)."""
        return replace(self, **{name: value for name, value in given.items() if value is not None})


def from_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """The defaults with the environment's overrides; a malformed one is a ValueError naming it."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Settings):
        raw = environ.get(ENV[f.name], "").strip()
        if raw:
            kind = int if f.type in ("int", int) else float
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise ValueError(f"{ENV[f.name]}: not a number: {raw!r}") from None
    return Settings(**values)


_current = Settings()


def install(settings: Settings) -> None:
    """The process's settings, from now on (the operator's main, before the handlers register)."""
    global _current
    _current = settings


def current() -> Settings:
    return _current
