"""``tokenmill cache list | info | rm | clear`` and the bundle flags of the engine commands."""

from __future__ import annotations

import gc
import json

from tokenmill.bundles.cache import BundleCache
from tokenmill.config import EngineConfig
from tokenmill.engine.loading import load_model
from tokenmill.entrypoints.args import engine_options
from tokenmill.entrypoints.cli import build_parser, main


def _bundle(model, root) -> str:
    config = EngineConfig(model=str(model), dtype="float32", max_model_len=64,
                          prepare_bundle=True, cache_dir=str(root))  # fmt: skip
    load_model(config)
    gc.collect()
    return BundleCache.for_config(config).bundles()[0].key


def test_list_info_rm_clear(tiny_llama_dir, tmp_path, capsys):
    key = _bundle(tiny_llama_dir, tmp_path)
    root = ["cache", "--cache-dir", str(tmp_path)]
    assert main([*root, "list"]) == 0
    out = capsys.readouterr().out
    assert key in out and str(tiny_llama_dir) in out and "1 bundles" in out
    assert main([*root, "info", key[:6]]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["key"] == key and info["load"]["dtype"] == "float32" and not info["in_use"]
    assert main([*root, "rm", "nope"]) == 2
    assert "no bundle" in capsys.readouterr().err
    assert main([*root, "rm", key]) == 0
    assert BundleCache(tmp_path, 0).bundles() == []
    _bundle(tiny_llama_dir, tmp_path)
    assert main([*root, "clear"]) == 0
    assert "removed 1 bundles" in capsys.readouterr().out


def test_serve_flags():
    args = build_parser().parse_args(
        ["serve", "--cache-dir", "/x", "--engine-cache-max-size-gb", "2.5",
         "--clear-engine-cache", "--prepare-bundle"]
    )  # fmt: skip
    opts = engine_options(args)
    assert (opts["cache_dir"], opts["engine_cache_max_size_gb"]) == ("/x", 2.5)
    assert opts["clear_engine_cache"] and opts["prepare_bundle"]
    off = engine_options(build_parser().parse_args(["serve", "--no-prepare-bundle"]))
    assert off["prepare_bundle"] is False and off["clear_engine_cache"] is False
    defaults = EngineConfig()
    plain = engine_options(build_parser().parse_args(["serve"]))
    for name in ("prepare_bundle", "cache_dir", "engine_cache_max_size_gb", "clear_engine_cache"):
        assert plain[name] == getattr(defaults, name)
