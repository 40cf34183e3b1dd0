"""What the routes share: the settings, the metrics, and — once the model is loaded — the model and its engine
loop; ``admit`` decides whether a request may enter (503 while loading, shutting down or after the engine process
died; 429 when full)."""

from __future__ import annotations

import time
from quanta.server.config import ServerConfig
from quanta.server.engine_loop import ENGINE_GONE, EngineLoop, ServedModel
from quanta.server.errors import queue_full, unavailable
from quanta.server.metrics import Metrics

LOADING_RETRY_S = 5
FULL_RETRY_S = 1


class ServerState:
    def __init__(self, config: ServerConfig, model_name: str):
        self.config, self.model_name = config, model_name
        self.metrics = Metrics()
        self.created = int(time.time())
        self.model: ServedModel | None = None
        self.engine_loop: EngineLoop | None = None
        self.draining = False

    def attach(self, model: ServedModel) -> None:
        """The model is loaded (its engine process runs): take requests."""
        self.model, self.engine_loop = model, model.engine_loop

    def ready(self) -> ServedModel:
        """The loaded model; 503 (with Retry-After) while it loads, once the server is shutting down, or when the
        engine process has died."""
        if self.draining:
            raise unavailable("the server is shutting down", "shutting_down", LOADING_RETRY_S)
        if self.model is None:
            raise unavailable("the model is still loading", "loading", LOADING_RETRY_S)
        if not self.model.engine_loop.alive:
            raise unavailable(ENGINE_GONE, "engine_stopped", LOADING_RETRY_S)
        return self.model

    def admit(self, n_sequences: int) -> EngineLoop:
        """Count a request's sequences in; 429 when the running batch and the queue are full."""
        self.ready()
        assert self.engine_loop is not None
        if not self.engine_loop.reserve(n_sequences):
            raise queue_full(self.config.max_queue, FULL_RETRY_S)
        return self.engine_loop
