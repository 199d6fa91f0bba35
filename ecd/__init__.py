"""ecd: a per-node daemon that owns the memory engines use to hand tensors to each other."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (AuthenticationFailed, DaemonUnavailable, EcdError, InvalidRequest, KeyNotFound, LimitExceeded,  # noqa: E402
                     NotOwner, PoolFull, ProtocolError, ShuttingDown, StaleGeneration)
from .errors import IntegrityError, PermissionDenied, PersistFailed, QuotaExceeded  # noqa: E402
from .errors import InvalidEndpoint, PoolNotVisible, SocketPermissionDenied  # noqa: E402


def __getattr__(name: str):
    # Loaded only when asked for: Client imports torch (and numpy), which `ecd serve` and the admin
    # commands never need; ControlClient (the control socket alone) imports neither.
    if name == "Client":
        from .client.client import Client
        return Client
    if name == "ControlClient":
        from .client.control import ControlClient
        return ControlClient
    if name == "FetchOutcome":
        from .client.control import FetchOutcome
        return FetchOutcome
    raise AttributeError(f"module 'ecd' has no attribute {name!r}")


__all__ = ["Client", "AuthenticationFailed", "EcdError", "KeyNotFound", "PoolFull", "DaemonUnavailable", "ProtocolError",
           "InvalidRequest", "LimitExceeded", "NotOwner", "ShuttingDown", "StaleGeneration",
           "__version__", "IntegrityError"]
__all__ += ["QuotaExceeded", "PersistFailed", "PermissionDenied", "InvalidEndpoint", "PoolNotVisible",
            "SocketPermissionDenied"]
__all__ += ["ControlClient", "FetchOutcome"]
