"""The bundle cache: corruption and stale versions rebuilt, pinned bundles refused, LRU
eviction under a cap that spares bundles in use, two processes building once."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from tokenmill.bundles.cache import BundleCache
from tokenmill.bundles.fingerprint import bundle_inputs, fingerprint
from tokenmill.bundles.store import WEIGHTS, StaleBundleError
from tokenmill.config import EngineConfig
from tokenmill.engine.loading import load_model


def _config(model, root, **options) -> EngineConfig:
    options = {"max_model_len": 64, "prepare_bundle": True, **options}
    return EngineConfig(model=str(model), dtype="float32", cache_dir=str(root), **options)


def _key(config: EngineConfig) -> str:
    return fingerprint(bundle_inputs(config))


def _events(caplog) -> list[str]:
    """ "written" / "mapped" for each bundle the loads wrote or mapped, in order."""
    words = [r.getMessage().split(" ")[3] for r in caplog.records
             if r.name == "tokenmill.bundles.cache" and r.getMessage().startswith("prepared bundle")]  # fmt: skip
    return [w for w in words if w in ("written", "mapped")]


def test_cold_then_warm(tiny_llama_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    config = _config(tiny_llama_dir, tmp_path)
    load_model(config)
    load_model(config)
    assert _events(caplog) == ["written", "mapped"]
    [info] = BundleCache.for_config(config).bundles()
    assert info.key == _key(config)
    assert info.manifest.model == str(tiny_llama_dir)
    assert set(info.manifest.files) >= {WEIGHTS, "config.json", "tokenizer/tokenizer.json"}
    for rel, entry in info.manifest.files.items():  # the weights' hashed as they were written
        data = (info.path / rel).read_bytes()
        assert (entry["size"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_bundle_is_rebuilt(tiny_llama_dir, tmp_path, caplog, damage):
    config = _config(tiny_llama_dir, tmp_path)
    load_model(config)
    weights = tmp_path / _key(config) / WEIGHTS
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    load_model(config)
    assert any("does not match its manifest" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)  # fmt: skip
    assert _events(caplog) == ["written"]
    caplog.clear()
    load_model(config)
    assert _events(caplog) == ["mapped"]


def test_warm_start_reads_no_checksum_until_a_file_is_written(
    tiny_llama_dir, tmp_path, caplog, monkeypatch
):
    """A verified file whose stat stamp is unchanged is not hashed again; a same-size
    rewrite with its modification time put back still changes the status-change time,
    so it is hashed, found corrupt and rebuilt."""
    from tokenmill.bundles import store

    config = _config(tiny_llama_dir, tmp_path)
    load_model(config)
    hashed: list[str] = []
    real = store._sha256

    def counting(path):
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(store, "_sha256", counting)
    load_model(config)
    assert hashed == []
    weights = tmp_path / _key(config) / WEIGHTS
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    load_model(config)
    assert WEIGHTS in hashed
    assert any("does not match its manifest" in r.getMessage() for r in caplog.records)
    assert _events(caplog) == ["written"]


def _age(folder, version: str) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["tokenmill_version"] = version
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_other_version_is_rebuilt(tiny_llama_dir, tmp_path, caplog):
    config = _config(tiny_llama_dir, tmp_path)
    load_model(config)
    _age(tmp_path / _key(config), "0.0.1")
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    load_model(config)
    assert any("built by tokenmill 0.0.1" in r.getMessage() for r in caplog.records)
    assert _events(caplog) == ["written"]


def test_pinned_bundle(tiny_llama_dir, tmp_path):
    config = _config(tiny_llama_dir, tmp_path)
    cold = load_model(config)
    folder = tmp_path / _key(config)
    pinned = load_model(EngineConfig(model=str(folder)))
    assert pinned.checkpoint.path == str(tiny_llama_dir)
    assert pinned.max_model_len == cold.max_model_len
    assert BundleCache(tmp_path, 0).bundles()[0].in_use  # eviction spares it
    del pinned
    gc.collect()
    _age(folder, "0.0.1")
    both = r"tokenmill 0\.0\.1 .*this is tokenmill 0\.1\.0 .*with prepare_bundle=True"
    with pytest.raises(StaleBundleError, match=both):
        load_model(EngineConfig(model=str(folder)))


def test_lru_eviction_spares_bundles_in_use(tiny_llama_dir, tmp_path):
    configs = [_config(tiny_llama_dir, tmp_path, max_model_len=n) for n in (32, 64, 128)]
    keys = [_key(c) for c in configs]
    for c in configs:
        del c
    load_model(configs[0])  # dropped at once: not in use
    size = BundleCache.for_config(configs[0]).bundles()[0].manifest.size
    cap_gb = 2.5 * size / (1 << 30)  # two bundles fit, three do not
    capped = [_config(tiny_llama_dir, tmp_path, max_model_len=n, engine_cache_max_size_gb=cap_gb)
              for n in (32, 64, 128)]  # fmt: skip
    load_model(capped[1])
    held = load_model(capped[0])  # warm: makes bundle 0 the most recent, and keeps it open
    gc.collect()
    load_model(capped[2])  # three bundles: the least recently used one (1) goes
    cache = BundleCache.for_config(capped[0])
    assert [b.key for b in cache.bundles()] == [keys[0], keys[2]]
    assert cache.bundles()[0].in_use
    assert cache.evict() == []  # within the cap
    cache.max_bytes = 0
    assert cache.evict() == [keys[2]]  # bundle 0 is open in this process
    assert not cache.remove(keys[0])
    del held
    gc.collect()
    assert cache.clear() == [keys[0]]
    assert cache.bundles() == []


def test_clear_engine_cache(tiny_llama_dir, tmp_path, caplog):
    load_model(_config(tiny_llama_dir, tmp_path))
    gc.collect()
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    load_model(_config(tiny_llama_dir, tmp_path, clear_engine_cache=True))
    assert _events(caplog) == ["written"]


def test_two_processes_build_once(tiny_llama_dir, tmp_path):
    script = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        from tokenmill.config import EngineConfig
        from tokenmill.engine.loading import load_model
        load_model(EngineConfig(model={str(tiny_llama_dir)!r}, dtype="float32", max_model_len=64,
                                prepare_bundle=True, cache_dir={str(tmp_path)!r}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    text = "".join(outs)
    assert text.count("tokenmill.bundles.cache prepared bundle") == 2
    assert text.count(" written in ") == 1 and text.count(" mapped in ") == 1
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".locks")] == [
        _key(_config(tiny_llama_dir, tmp_path))
    ]


def test_leftovers_of_dead_processes_are_swept(tmp_path):
    cache = BundleCache(tmp_path, 1 << 30)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    for name in (f".tmp-abc-{dead}", f".trash-abc-{dead}", f".tmp-def-{os.getpid()}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / WEIGHTS).write_bytes(b"x")
    assert sorted(cache.sweep()) == [f".tmp-abc-{dead}", f".trash-abc-{dead}"]
    assert (tmp_path / f".tmp-def-{os.getpid()}").is_dir()  # a live writer's


def test_on_by_default(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=64)
    assert config.prepare_bundle and config.cache_dir is None
    load_model(config)
    load_model(config)
    assert _events(caplog) == ["written", "mapped"]
    assert (tmp_path / "bundles" / _key(config) / WEIGHTS).is_file()


def test_opt_out_writes_nothing(tiny_llama_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    for _ in range(2):
        load_model(_config(tiny_llama_dir, tmp_path / "cache", prepare_bundle=False))
    assert _events(caplog) == [] and not (tmp_path / "cache").exists()


def _not_written(caplog) -> str:
    [message] = [r.getMessage() for r in caplog.records if "no prepared bundle" in r.getMessage()]
    assert _events(caplog) == []
    return message


def test_bundle_larger_than_the_cap_is_not_written(tiny_llama_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    config = _config(tiny_llama_dir, tmp_path, engine_cache_max_size_gb=1e-6)
    for _ in range(2):  # cold both times
        assert load_model(config).model is not None
    [first, second] = [r.getMessage() for r in caplog.records if "no prepared" in r.getMessage()]
    assert "exceed engine_cache_max_size_gb" in first and first == second
    assert _events(caplog) == []
    assert BundleCache.for_config(config).bundles() == []


def test_bundle_is_not_written_onto_a_full_disk(tiny_llama_dir, tmp_path, caplog, monkeypatch):
    import shutil

    from tokenmill.bundles import cache as cache_module

    usage = shutil.disk_usage(tmp_path)
    full = usage._replace(free=cache_module.MIN_FREE_BYTES + 1000)  # less than a bundle's
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: full)
    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    config = _config(tiny_llama_dir, tmp_path)
    load_model(config)
    assert "GiB free on the disk of" in _not_written(caplog)
    assert BundleCache.for_config(config).bundles() == []


def test_model_with_uncapturable_state_is_not_written(tiny_llama_dir, tmp_path, caplog):
    import torch

    from tokenmill.engine.loading import _build_model

    def cold(config):
        loaded = _build_model(config)
        loaded.model.extra = torch.zeros(3)  # state outside the parameters and buffers
        return loaded

    caplog.set_level(logging.INFO, "tokenmill.bundles.cache")
    config = _config(tiny_llama_dir, tmp_path)
    BundleCache.for_config(config).load_or_build(config, cold)
    assert "model.extra is a tensor outside the parameters" in _not_written(caplog)


def test_unwritable_cache_dir_starts_cold(tiny_llama_dir, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    caplog.set_level(logging.WARNING, "tokenmill.engine.loading")
    loaded = load_model(_config(tiny_llama_dir, blocker / "bundles"))
    assert loaded.model is not None
    assert "prepared bundles are off for this start" in caplog.text


def test_gguf_bundle_copies_the_converted_tokenizer(smollm2_gguf, tmp_path):
    """A GGUF's tokenizer, converted and cached in the fast form, is copied into the bundle
    as it is (not saved and checked again), and the warm load's tokenizer encodes alike."""
    from tokenmill.tokenizer.gguf_tokenizer import cache_path

    config = _config(smollm2_gguf, tmp_path)
    cold = load_model(config)
    saved = tmp_path / _key(config) / "tokenizer"
    cached = cache_path(smollm2_gguf)
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in cached.iterdir())
    for path in cached.iterdir():
        assert (saved / path.name).read_bytes() == path.read_bytes()
    warm = load_model(config)
    text = "Hello 日本語 <|im_start|>user\n  x"
    assert warm.tokenizer.encode(text) == cold.tokenizer.encode(text)


def test_warm_start_skips_the_tokenizer_auto_classes(smollm2_gguf, tmp_path):
    """A warm start loads the bundle's generic fast tokenizer: transformers' auto classes
    (0.6 s of imports, several times the rest of a warm start) are never imported."""
    script = textwrap.dedent(f"""
        import sys
        from tokenmill.config import EngineConfig
        from tokenmill.engine.loading import load_model
        config = EngineConfig(model={str(smollm2_gguf)!r}, cache_dir={str(tmp_path)!r})
        load_model(config)
        if sys.argv[1] == "warm":
            print("transformers.models.auto.tokenization_auto" in sys.modules)
    """)
    subprocess.run([sys.executable, "-c", script, "cold"], check=True)
    out = subprocess.run([sys.executable, "-c", script, "warm"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    assert out.split() == ["False"]


@pytest.mark.parametrize("model", ["missing-folder", "org/hub-id"])
@pytest.mark.parametrize("prepare", [True, False])
def test_missing_model_error_is_the_same_with_bundles(tmp_path, model, prepare):
    """The key is computed before the load: a path that does not exist still gets the
    loader's message (no model hub), not a complaint about a missing config.json."""
    from tokenmill.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist; pass a local Hugging Face"):
        load_model(_config(tmp_path / model, tmp_path / "cache", prepare_bundle=prepare))
