"""The master's API keys, whatever the transport: which keys it takes and whether a request's
`Authorization` value holds one. The HTTP API (api/api_keys) and the gRPC API (api/grpc_keys) both
ask here, so one key opens both and no door is left open beside a locked one.

The keys come from the environment of `lopa master` (LOPA_API_KEY, several separated by commas;
`lopa serve --api-key` sets it for its master), never from a file another process may read, and
they are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Collection, Mapping

from lopa.serving.shared.config import API_KEY_ENV


def api_keys(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The keys of LOPA_API_KEY (empty: the API is open)."""
    raw = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
    return frozenset(key.strip() for key in raw.split(",") if key.strip())


def authorized(value: str, keys: Collection[str]) -> bool:
    """`value` (an Authorization header, or gRPC's authorization metadata) is "Bearer <one of keys>"."""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    given = token.strip().encode()
    # Every key compared, each in constant time: the answer's timing tells nothing of the keys.
    return any([hmac.compare_digest(given, key.encode()) for key in keys])  # a list: no short cut
