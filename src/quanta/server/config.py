"""The server's settings, read once by `quanta serve` (or a test) and fixed for the server's life."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY = 8 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    """host/port: where to listen (127.0.0.1 by default: the server is local unless asked otherwise).
    api_key: when set, every route but /health and the chat page needs ``Authorization: Bearer <key>``.
    max_queue: requests that may wait for a batch slot beyond the running ones; more are refused with 429.
    cors_origins: origins a browser may call the API from ("*" for any); none by default.
    max_body_bytes: larger request bodies are refused with 413.
    shutdown_grace_s: on SIGINT/SIGTERM, how long in-flight requests may run on before they are ended.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 512
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be 0 or more, got {self.shutdown_grace_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")
