"""The safetensors cache of converted GGUF files: dequantise once, memory-map ever after.

A restart after a failure reloads from here, so it takes milliseconds, not a reconversion.
Files are keyed by the sha256 of the GGUF content and written atomically (tmp + rename), so a
crash mid-write leaves no bad cache; one that still fails to load is reconverted. No torch
import at module level (safetensors brings it in only when a cache is loaded).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tokstream import envs
from tokstream.config import ModelConfig
from tokstream.errors import CorruptModelError
from tokstream.model.gguf_file import load_gguf_tensors
from tokstream.model.hf_folder import check_tensor_shapes, tensor_shapes

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tokstream.model")

# Bump when the conversion changes, so caches written by an older converter are not reused.
CACHE_FORMAT = "tokstream-gguf-float32-v1"
INDEX_FILE = "index.json"


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/tokstream, default ~/.cache/tokstream."""
    return envs.cache_root() / "tokstream"


def gguf_sha256(gguf_path: str | Path) -> str:
    """sha256 of the file's content; remembered per (path, size, mtime) to skip rehashing."""
    path = Path(gguf_path).resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise CorruptModelError(f"{path} cannot be read: {e.strerror or e}") from None
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    index_path = cache_dir() / INDEX_FILE
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path)) if isinstance(index, dict) else None
    if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and "sha256" in entry:
        return entry["sha256"]
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as e:
        raise CorruptModelError(f"{path} cannot be read: {e.strerror or e}") from None
    index = index if isinstance(index, dict) else {}
    index[str(path)] = {**stamp, "sha256": digest.hexdigest()}
    try:
        _write_atomically(index_path, lambda tmp: Path(tmp).write_text(json.dumps(index)))
    except OSError as e:  # a read-only cache only costs a rehash next time
        log.warning("cannot update %s: %s", index_path, e)
    return digest.hexdigest()


def cache_path(gguf_path: str | Path) -> Path:
    return cache_dir() / f"{gguf_sha256(gguf_path)}.{CACHE_FORMAT}.safetensors"


def load_gguf_cached(gguf_path: str | Path, config: ModelConfig) -> dict[str, "torch.Tensor"]:
    """HF-named float32 CPU tensors of a GGUF file, memory-mapped from the cache; the first
    call converts. Tensors of a tied model include no lm_head.weight."""
    path = cache_path(gguf_path)
    tensors = _load(path, config)
    if tensors is not None:
        return tensors
    # Ranks of one tensor-parallel group start together: one converts, the others wait for it.
    with _file_lock(path.with_suffix(".lock")):
        tensors = _load(path, config)
        if tensors is not None:
            return tensors
        # Holding the lock, no one else writes this entry: tmp files left by a killed
        # converter are garbage (hundreds of MB each).
        for stale in path.parent.glob(path.name + ".*.tmp"):
            stale.unlink(missing_ok=True)
        return convert(gguf_path, config, path)


def convert(gguf_path: str | Path, config: ModelConfig, path: Path) -> dict[str, "torch.Tensor"]:
    """Dequantise the GGUF and write it to `path`; returns the tensors either way, so an
    unwritable cache costs speed on the next start, not the load."""
    import torch
    from safetensors.numpy import save_file

    start = time.perf_counter()
    arrays = load_gguf_tensors(gguf_path, config)
    try:
        _write_atomically(path, lambda tmp: save_file(
            arrays, tmp, metadata={"format": CACHE_FORMAT, "source": Path(gguf_path).name}))
    except OSError as e:
        log.warning("cannot write the weights cache %s (%s); using the conversion uncached",
                    path, e)
        return {name: torch.from_numpy(a) for name, a in arrays.items()}
    log.info("converted %s to %s in %.1f s", gguf_path, path, time.perf_counter() - start)
    return _load(path, config) or {name: torch.from_numpy(a) for name, a in arrays.items()}


def _load(path: Path, config: ModelConfig) -> dict[str, "torch.Tensor"] | None:
    """The cached tensors, or None when the cache is absent or unusable (then reconverted)."""
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        return None
    start = time.perf_counter()
    try:
        with safe_open(path, framework="pt") as f:
            if (f.metadata() or {}).get("format") != CACHE_FORMAT:
                raise CorruptModelError("written by another converter version")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        check_tensor_shapes(config, {k: tuple(t.shape) for k, t in tensors.items()}, str(path))
    except (OSError, SafetensorError, CorruptModelError) as e:
        log.warning("weights cache %s is unusable (%s); reconverting", path, e)
        return None
    log.info("loaded cached weights %s in %.2f s", path, time.perf_counter() - start)
    return {name: tensors[name] for name in tensor_shapes(config)}


def _write_atomically(path: Path, write) -> None:
    """write(tmp_path) then rename onto `path`: readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextmanager
def _file_lock(lock_path: Path):
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")
    except OSError:  # unwritable cache dir: convert without a lock; the write fails softly
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
