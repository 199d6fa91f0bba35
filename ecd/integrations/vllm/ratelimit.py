"""The connectors' loggers, and log lines for failures that repeat every step: one line per kind
per interval, and the lines held back in between are counted into the next one. Thread-safe."""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

# vLLM configures only the loggers under "vllm" (a handler on "vllm", propagate=False), so a logger
# named after our module would print nothing in an engine: ours are children of vLLM's and show in
# its output with its format and VLLM_LOGGING_LEVEL. Without vLLM's set-up (VLLM_CONFIGURE_LOGGING=0)
# they propagate to the root logger like any other.
LOGGER_PREFIX = "vllm.ecd."


def connector_logger(name: str) -> logging.Logger:
    """The logger of one connector module, e.g. connector_logger("kv_connector") ->
    "vllm.ecd.kv_connector"."""
    return logging.getLogger(LOGGER_PREFIX + name)


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float, prefix: str = "") -> None:
        self.logger = logger
        self.interval = interval
        self.prefix = prefix
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, message: str, *args: Any, exc_info: bool | BaseException = False,
            stacklevel: int = 1) -> None:
        """`stacklevel` as in logging, counted from the caller of this method: the record names
        the file and line that reported the failure, not this module."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -math.inf) < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            message += " (%d similar since the last report)"
            args = (*args, held)
        self.logger.log(level, self.prefix + message, *args, exc_info=exc_info, stacklevel=stacklevel + 1)

    def warning(self, key: str, message: str, *args: Any) -> None:
        self.log(logging.WARNING, key, message, *args, stacklevel=2)
