"""The bundle cache: one folder per key under ``cache_dir``, shared safely by processes.

Layout of ``root`` (``EngineConfig.cache_dir``, default ``$TOKENMILL_CACHE_DIR/bundles``)::

    <key>/              a bundle (``store.py``), only ever renamed into place whole
    .locks/<key>.build  exclusive flock while a process builds <key>
    .locks/<key>.use    shared flock held by every process that has <key> mapped
    .tmp-<key>-<pid>/   a bundle being written (renamed to <key> when complete)
    .trash-<key>-<pid>/ a bundle being deleted (renamed away from <key> first)

Leftovers of a process that died while writing or deleting are swept by ``evict``/``clear``.

- Two processes loading one model: both miss, one takes the build lock and builds, the
  other waits on the lock and then maps what the first wrote.
- A bundle failing its checksums, or of another version/format, is rebuilt with a warning.
- Eviction (least recently used first, until the cache fits ``engine_cache_max_size_gb``)
  takes a bundle's ``.use`` lock exclusively without waiting, so a mapped bundle is never
  removed; it is renamed away under that lock before it is deleted.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.bundles.capture import check_capturable, model_tensors
from tokenmill.bundles.fingerprint import bundle_inputs, fingerprint
from tokenmill.bundles.phases import Phases
from tokenmill.bundles.store import (
    MANIFEST,
    CorruptBundleError,
    Manifest,
    Prepared,
    StaleBundleError,
    check_bundle,
    read_bundle,
    write_bundle,
)
from tokenmill.env import cache_dir
from tokenmill.errors import ModelLoadError
from tokenmill.loader.resolve import resolve_model

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.loading import LoadedModel

logger = logging.getLogger(__name__)

MIN_FREE_BYTES = 1 << 30
"""A bundle is not written when it would leave less free disk than this."""


@dataclass(frozen=True)
class BundleInfo:
    """One cached bundle, as ``tokenmill cache list`` shows it."""

    key: str
    path: Path
    manifest: Manifest
    in_use: bool


def default_root() -> Path:
    return cache_dir() / "bundles"


def is_bundle(path: str | None) -> bool:
    """Whether ``path`` names a bundle folder (a pinned bundle passed as the model)."""
    return path is not None and (Path(path).expanduser() / MANIFEST).is_file()


class BundleCache:
    """Bundles under ``root``, at most ``max_bytes`` in all (the newest may exceed it alone)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        (root / ".locks").mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_config(cls, config: EngineConfig) -> BundleCache:
        root = Path(config.cache_dir).expanduser() if config.cache_dir else default_root()
        return cls(root, int(config.engine_cache_max_size_gb * (1 << 30)))

    # -- loading ---------------------------------------------------------------------------
    def load_or_build(
        self, config: EngineConfig, cold: Callable[[EngineConfig], LoadedModel]
    ) -> Prepared | LoadedModel:
        """The warm model of ``config``'s bundle, or a cold load that is then written."""
        if config.clear_engine_cache:
            logger.info("clear_engine_cache: removed %d bundles", len(self.clear()))
        key = fingerprint(bundle_inputs(config))
        warm = self._open(key, config)
        if warm is not None:
            return warm
        with _locked(self._lock(key, "build"), fcntl.LOCK_EX):  # one builder per key
            warm = self._open(key, config)  # built while we waited
            if warm is not None:
                return warm
            loaded = cold(config)
            skip = self._skip_reason(loaded.model)
            if skip is not None:
                logger.info("no prepared bundle of %s: %s", loaded.checkpoint.path, skip)
                return loaded
            logger.info("writing the prepared bundle %s to %s: later starts map it "
                        "(prepare_bundle=False / --no-prepare-bundle: skip)", key, self.root)  # fmt: skip
            start = time.perf_counter()
            try:
                self._write(key, loaded, config)
            except (OSError, ModelLoadError) as e:  # costs the next start, never this one
                logger.warning("could not write the prepared bundle %s: %s", key, e)
                return loaded
            seconds = time.perf_counter() - start
            logger.info("prepared bundle %s written in %.2f s", key, seconds)
            loaded = dataclasses.replace(loaded, phases={**loaded.phases, "bundle write": seconds})
        self.evict(keep=key)
        return loaded

    @staticmethod
    def load_pinned(config: EngineConfig) -> Prepared:
        """The bundle folder named as ``config.model``: used as it is or refused (another
        version, failed checksums), never rebuilt. The bundle's own resolution (dtype,
        quantization, max_model_len) applies."""
        path = Path(str(config.model)).expanduser()
        locks = path.parent / ".locks"  # inside a cache: eviction must see it in use
        fd = _open_lock(locks / f"{path.name}.use") if locks.is_dir() else None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            manifest = check_bundle(path, pinned=True)
            warm = read_bundle(path, config, manifest.model)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        if fd is not None:
            weakref.finalize(warm.model, os.close, fd)
        return warm

    def _open(self, key: str, config: EngineConfig) -> Prepared | None:
        folder = self.root / key
        fd = _open_lock(self._lock(key, "use"))
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while the bundle is mapped
        try:
            if not (folder / MANIFEST).is_file():
                os.close(fd)
                return None
            start, phases = time.perf_counter(), Phases()
            with phases("resolve"):
                manifest = check_bundle(folder)
            warm = read_bundle(folder, config, _model_path(config), phases)
        except (StaleBundleError, CorruptBundleError, ModelLoadError) as e:
            os.close(fd)
            logger.warning("prepared bundle %s is unusable, rebuilding it: %s", key, e)
            self.remove(key)
            return None
        except BaseException:
            os.close(fd)
            raise
        weakref.finalize(warm.model, os.close, fd)  # the shared lock lives with the model
        manifest.last_used = time.time()
        manifest.save(folder)
        logger.info("prepared bundle %s mapped in %.2f s (%s)", key, time.perf_counter() - start,
                    folder)  # fmt: skip
        return warm

    def _skip_reason(self, model: torch.nn.Module) -> str | None:
        """Why the bundle of ``model`` (a cold load) is not written, or None: state a
        bundle can not restore, a bundle larger than the cap, or too little free disk
        (the write would leave under ``MIN_FREE_BYTES``: other programs need the disk
        more than this start-up cache)."""
        try:
            check_capturable(model)
        except ModelLoadError as e:
            return str(e)
        tensors, _ = model_tensors(model)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.max_bytes:
            return (f"its {size / (1 << 30):.1f} GiB exceed engine_cache_max_size_gb "
                    f"({self.max_bytes / (1 << 30):.1f})")  # fmt: skip
        free = shutil.disk_usage(self.root).free
        if size + MIN_FREE_BYTES > free:
            return (f"{size / (1 << 30):.1f} GiB would leave less than "
                    f"{MIN_FREE_BYTES >> 30} GiB free on the disk of {self.root}")  # fmt: skip
        return None

    def _write(self, key: str, loaded: LoadedModel, config: EngineConfig) -> None:
        tmp = self.root / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write_bundle(tmp, key, Prepared(*_fields(loaded)), config)
            self.remove(key)  # a stale or corrupt one under this key (we hold the build lock)
            os.rename(tmp, self.root / key)  # atomic: readers see no bundle or a whole one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- management ------------------------------------------------------------------------
    def bundles(self) -> list[BundleInfo]:
        """Every readable bundle, least recently used first."""
        found = []
        for folder in sorted(
            p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
        ):
            try:
                manifest = Manifest.load(folder)
            except CorruptBundleError:
                continue
            found.append(BundleInfo(folder.name, folder, manifest, self._in_use(folder.name)))
        return sorted(found, key=lambda b: b.manifest.last_used)

    def remove(self, key: str) -> bool:
        """Delete bundle ``key`` unless a process has it mapped; whether it was removed."""
        folder = self.root / key
        if not folder.exists():
            return False
        fd = _open_lock(self._lock(key, "use"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            trash = self.root / f".trash-{key}-{os.getpid()}"
            os.rename(folder, trash)
            shutil.rmtree(trash, ignore_errors=True)
        finally:
            os.close(fd)
        return True

    def clear(self) -> list[str]:
        """Remove every bundle not in use (and leftovers of dead writers); the keys removed."""
        self.sweep()
        return [b.key for b in self.bundles() if self.remove(b.key)]

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used bundles (never ``keep``, never one in use) until the
        cache fits ``max_bytes``; the keys removed, in order."""
        self.sweep()
        bundles = self.bundles()
        total = sum(b.manifest.size for b in bundles)
        removed = []
        for b in bundles:
            if total <= self.max_bytes:
                break
            if b.key != keep and self.remove(b.key):
                total -= b.manifest.size
                removed.append(b.key)
                logger.info("evicted prepared bundle %s (%s)", b.key, b.manifest.model)
        return removed

    def sweep(self) -> list[str]:
        """Delete the ``.tmp-*`` / ``.trash-*`` folders of processes that died mid-write or
        mid-removal (their pid ends the name); the names removed."""
        removed = []
        for folder in self.root.glob(".t*-*-*"):
            kind, _, pid = folder.name.rpartition("-")
            if kind.startswith((".tmp-", ".trash-")) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder.name)
        return removed

    def _in_use(self, key: str) -> bool:
        fd = _open_lock(self._lock(key, "use"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops our lock
        return False

    def _lock(self, key: str, kind: str) -> Path:
        return self.root / ".locks" / f"{key}.{kind}"


def _model_path(config: EngineConfig) -> str:
    """The checkpoint path ``load_checkpoint`` would report for ``config.model``."""
    return str(resolve_model(config.model)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _fields(loaded: LoadedModel) -> tuple:
    return (loaded.checkpoint, loaded.model, loaded.tokenizer, loaded.max_model_len,
            loaded.dtype, loaded.device, loaded.quantization, loaded.phases)  # fmt: skip


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


class _locked:
    """``with _locked(path, fcntl.LOCK_EX):`` holds an flock on ``path`` for the block."""

    def __init__(self, path: Path, mode: int) -> None:
        self.path, self.mode, self.fd = path, mode, -1

    def __enter__(self) -> None:
        self.fd = _open_lock(self.path)
        fcntl.flock(self.fd, self.mode)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
