"""``tokenmill cache list | info KEY | rm KEY | clear``: show and manage prepared bundles."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill.bundles.cache import BundleCache, BundleInfo, default_root


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``cache`` command on the CLI's subparsers ``sub``."""
    cache = sub.add_parser(
        "cache",
        help="list and manage the prepared-model bundles",
        description="Prepared-model bundles (written by every CPU load unless "
        "prepare_bundle=False / --no-prepare-bundle): list them, show one, remove one or all. A KEY may be shortened "
        "to any unique prefix. Bundles open in a running process are never removed.",
    )
    cache.add_argument("--cache-dir", help="bundle folder (default: $TOKENMILL_CACHE_DIR/bundles)")
    actions = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    actions.add_parser("list", help="every bundle: key, size, model, created, last used")
    actions.add_parser("info", help="one bundle's manifest and resolved load").add_argument("key")
    actions.add_parser("rm", help="remove one bundle").add_argument("key")
    actions.add_parser("clear", help="remove every bundle not in use")
    return cache


def cmd_cache(args: argparse.Namespace) -> int:
    root = Path(args.cache_dir).expanduser() if args.cache_dir else default_root()
    cache = BundleCache(root, max_bytes=0)
    if args.cache_command == "list":
        _list(cache.bundles(), root)
        return 0
    if args.cache_command == "clear":
        removed = cache.clear()
        print(f"removed {len(removed)} bundles from {root}")
        return 0
    info = _find(cache, args.key)
    if args.cache_command == "info":
        resolved = json.loads((info.path / "config.json").read_text())
        summary = {k: resolved[k] for k in ("format", "model_class", "dtype", "quantization",
                                           "max_model_len", "attention_backend")}  # fmt: skip
        manifest = vars(info.manifest) | {"path": str(info.path), "in_use": info.in_use}
        print(json.dumps(manifest | {"load": summary}, indent=2))
        return 0
    if not cache.remove(info.key):
        print(f"error: bundle {info.key} is open in a running process", file=sys.stderr)
        return 1
    print(f"removed {info.key}")
    return 0


def _find(cache: BundleCache, prefix: str) -> BundleInfo:
    found = [b for b in cache.bundles() if b.key.startswith(prefix)]
    if len(found) != 1:
        what = "no bundle" if not found else f"{len(found)} bundles"
        raise ValueError(
            f"{what} in {cache.root} with a key starting {prefix!r}; see `tokenmill cache list`"
        )
    return found[0]


def _list(bundles: list[BundleInfo], root: Path) -> None:
    rows = [("KEY", "SIZE", "MODEL", "CREATED", "LAST USED", "IN USE")]
    for b in reversed(bundles):  # most recently used first
        m = b.manifest
        rows.append((b.key, _size(m.size), m.model, _when(m.created), _when(m.last_used),
                     "yes" if b.in_use else ""))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    total = sum(b.manifest.size for b in bundles)
    print(f"{len(bundles)} bundles, {_size(total)} in {root}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return ""


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
