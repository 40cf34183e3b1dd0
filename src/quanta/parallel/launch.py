"""Starting a tensor-parallel group: one process per rank, rank 0 the caller's (the lead), the others spawned.

The lead owns the tokenizer, the scheduler and sampling (the whole engine); every rank holds its part of the
weights (quanta.parallel.shard) and of the KV cache. Each step the lead's model runner sends the step's host inputs
over a pipe to every follower (``TensorParallel.lead``) and all ranks run the same forward, joined by the
collectives inside it (quanta.parallel.group). Startup: the ranks meet in ``torch.distributed`` (a TCP store on
localhost), load their parts side by side, report back, then agree on the KV pool's blocks (the smallest any
rank's memory allows) before the engine starts.

A follower that fails while loading is reported by the lead as a QuantaError; one that dies later leaves the
lead's next send failing (or its collective waiting until the group's timeout).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from quanta.engine.config import EngineConfig
from quanta.errors import QuantaError

# NVLink multicast (NVLS) stays off unless the caller's environment says otherwise: the GPU machines this runs on
# require it (a program using it can take shared GPUs out of service), and nothing here needs it
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT = timedelta(minutes=10)  # a collective waiting this long means a rank is gone
LOAD_POLL_S = 1.0


@dataclass(frozen=True)
class GroupSpec:
    """What every rank needs to load its part: the GGUF file, the context, one device per rank, the CUDA
    backend's switches, and the collectives' backend ("nccl" between GPUs; "gloo" for CPU tensors or ranks
    sharing a GPU)."""

    path: str
    devices: tuple[str, ...]
    n_ctx: int | None = None
    backend: dict[str, Any] = field(default_factory=dict)
    collectives: str = "nccl"
    port: int = 0
    init: Callable[[], None] | None = None  # called first in each follower (a module-level function: pickled)

    @property
    def world(self) -> int:
        return len(self.devices)


def gpu_devices(device: str, world: int) -> tuple[str, ...]:
    """The ``world`` GPUs a group on ``device`` ("cuda" or "cuda:N", the first) runs on; a clear error where the
    machine has fewer."""
    try:
        import torch
    except ImportError:
        raise QuantaError("tensor parallelism needs torch with CUDA; it is not installed") from None
    first = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if first + world > count:
        raise QuantaError(f"tensor parallelism over {world} GPUs from cuda:{first} needs {first + world} GPUs; this "
                          f"machine has {count}")
    return tuple(f"cuda:{first + r}" for r in range(world))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Spawned followers without the caller's main module: multiprocessing's spawn would import it again in each
    child (running a script's top level, and failing without an ``if __name__ == "__main__"`` guard); a follower
    needs only quanta."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _join(spec: GroupSpec, rank: int) -> Any:
    """This process as rank ``rank`` of the group; its backend."""
    import torch
    import torch.distributed as dist

    from quanta.backends.cuda import CUDABackend

    device = torch.device(spec.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    backend = CUDABackend(spec.devices[rank], **{"graphs": spec.collectives == "nccl", **spec.backend})
    dist.init_process_group(spec.collectives, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                            world_size=spec.world, timeout=TIMEOUT)
    return backend


def _load(spec: GroupSpec, rank: int, backend: Any, followers: list[Connection]) -> Any:
    """Rank ``rank``'s part of the model."""
    from quanta import gguf
    from quanta.models import load_model, model_config
    from quanta.parallel.group import TensorParallel
    from quanta.parallel.shard import ShardPlan

    file = gguf.open(spec.path)
    plan = ShardPlan.build(model_config(file), file.tensors, rank, spec.world)
    return load_model(file, backend, spec.n_ctx, TensorParallel(plan, followers))


def _agreed(config: EngineConfig, model: Any, backend: Any) -> EngineConfig:
    """``config`` (resolved) with the KV pool's blocks every rank can hold: the fewest any rank's memory allows."""
    import torch
    import torch.distributed as dist

    from quanta.engine.model_runner import pool_blocks

    n = torch.tensor([pool_blocks(model, backend, config, model.n_ctx)], dtype=torch.int64,
                     device=backend.device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return replace(config, kv_blocks=int(n.item()))


def follow(spec: GroupSpec, rank: int, conn: Connection) -> None:
    """A follower process: join, load, report, agree on the pool, then run every forward the lead sends until it
    sends None."""
    import torch.distributed as dist

    from quanta.engine.model_runner import ModelRunner

    try:
        if spec.init is not None:
            spec.init()
        backend = _join(spec, rank)
        model = _load(spec, rank, backend, [])
    except Exception as e:  # noqa: BLE001 - reported to the lead, which raises it to the user
        conn.send(f"rank {rank}: {type(e).__name__}: {e}")
        return
    conn.send(None)
    try:
        config = conn.recv()
        if config is None:
            return
        runner = ModelRunner(model, backend, _agreed(config, model, backend), model.n_ctx)
        while (step := conn.recv()) is not None:
            runner.execute(*step)
    except EOFError:  # the lead's process is gone: nothing left to follow
        return
    backend.synchronize()
    dist.destroy_process_group()


class LeadRank:
    """Rank 0 of a group started for ``spec``: ``model`` and ``backend`` are its part; :meth:`engine_config` fixes
    the engine's settings on every rank; :meth:`close` stops the followers."""

    def __init__(self, spec: GroupSpec):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise QuantaError("this process already belongs to a torch.distributed group: one tensor-parallel model "
                              "per process (close the other first)")
        for k, v in NCCL_DEFAULTS.items():
            os.environ.setdefault(k, v)
        self.spec = spec = replace(spec, port=spec.port or _free_port())
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.processes = []
        with _main_not_rerun():
            for rank in range(1, spec.world):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=follow, args=(spec, rank, theirs), name=f"quanta-tp-{rank}", daemon=True)
                p.start()
                self.conns.append(mine)
                self.processes.append(p)
        try:
            self.backend = _join(spec, 0)
            self.model = _load(spec, 0, self.backend, self.conns)
            self._wait_loaded()
        except BaseException:
            self.close()
            raise

    def _wait_loaded(self) -> None:
        for rank, (conn, p) in enumerate(zip(self.conns, self.processes), start=1):
            while not conn.poll(LOAD_POLL_S):
                if not p.is_alive():
                    raise QuantaError(f"tensor-parallel rank {rank} exited while loading (exit code {p.exitcode})")
            error = conn.recv()
            if error is not None:
                raise QuantaError(f"tensor-parallel rank {error}")

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """``config`` resolved for the backend, with the KV pool's size agreed by every rank."""
        config = config.resolved(self.backend.name)
        for conn in self.conns:
            conn.send(config)
        return _agreed(config, self.model, self.backend)

    def close(self) -> None:
        """Stop the followers (each finishes its queued work) and leave the group."""
        import torch.distributed as dist

        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pass
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self.conns, self.processes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
