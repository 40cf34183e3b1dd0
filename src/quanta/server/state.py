"""What the routes share: the settings, the metrics, and — once the model is loaded — the model and its engine
loop; ``admit`` decides whether a request may enter (503 while loading or shutting down, 429 when full)."""

from __future__ import annotations

import time
from typing import Any

from quanta.server.config import ServerConfig
from quanta.server.engine_loop import EngineLoop
from quanta.server.errors import queue_full, unavailable
from quanta.server.metrics import Metrics

LOADING_RETRY_S = 5
FULL_RETRY_S = 1


class ServerState:
    def __init__(self, config: ServerConfig, model_name: str):
        self.config, self.model_name = config, model_name
        self.metrics = Metrics()
        self.created = int(time.time())
        self.llm: Any = None
        self.engine_loop: EngineLoop | None = None
        self.draining = False

    def attach(self, llm: Any) -> None:
        """The model is loaded: start its engine loop and take requests."""
        engine = llm.engine
        loop = EngineLoop(engine, self.metrics, engine.config.max_seqs + self.config.max_queue)
        loop.start()
        self.llm, self.engine_loop = llm, loop

    def ready(self) -> Any:
        """The loaded model; 503 (with Retry-After) while it loads or once the server is shutting down."""
        if self.draining:
            raise unavailable("the server is shutting down", "shutting_down", LOADING_RETRY_S)
        if self.llm is None:
            raise unavailable("the model is still loading", "loading", LOADING_RETRY_S)
        return self.llm

    def admit(self, n_sequences: int) -> EngineLoop:
        """Count a request's sequences in; 429 when the running batch and the queue are full."""
        self.ready()
        assert self.engine_loop is not None
        if not self.engine_loop.reserve(n_sequences):
            raise queue_full(self.config.max_queue, FULL_RETRY_S)
        return self.engine_loop
