from __future__ import annotations

from pathlib import Path

from tokenmill import env


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_CACHE_DIR", raising=False)
    assert env.cache_dir() == Path.home() / ".cache" / "tokenmill"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    assert env.cache_dir() == tmp_path
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", "")
    assert env.cache_dir() == Path.home() / ".cache" / "tokenmill"


def test_every_variable_is_registered_and_documented():
    assert "TOKENMILL_CACHE_DIR" in env.ENV_VARS
    for name, var in env.ENV_VARS.items():
        assert name == var.name and name.startswith("TOKENMILL_") and var.doc
