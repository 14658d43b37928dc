"""The persistent compilation cache of `tpurl train` (`tpurl.compile_cache`): a second run of the
same config loads every program its first run compiled and compiles none; with the cache off,
nothing is kept; a bounded cache works and refuses a directory written without a bound; where the
cache lives; a changed cache or compile-ahead setting does not block `--resume`."""

import json
import os
import subprocess
import sys

import pytest

from multiprocess_helpers import cpu_env
from tpurl import compile_cache
from tpurl.compile_cache import CompileCacheConfig, enable
from tpurl.rl.config import RLConfig
from tpurl.rl.resume import check_resume_config, config_record

GIN = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "test_tiny.gin")


def _train(run_dir, cache, env=None, max_bytes=None, returncode=0):
    cmd = [sys.executable, "-m", "tpurl", "train", "--gin_file", GIN,
           "--gin_param", f"tpurl.LoggingConfig.run_dir='{run_dir}'", "--gin_param", "tpurl.EvalConfig.pass_k=1",
           "--gin_param", "tpurl.RLConfig.compile_cache=@tpurl.CompileCacheConfig()",
           "--gin_param", f"tpurl.CompileCacheConfig.dir={cache!r}" if cache else "tpurl.CompileCacheConfig.dir=None",
           "--gin_param", f"tpurl.CompileCacheConfig.max_bytes={max_bytes}"]
    out = subprocess.run(cmd, env={**cpu_env(8), **(env or {})}, capture_output=True, text=True, timeout=600)
    assert out.returncode == returncode, out.stderr[-3000:]
    if returncode:
        return out.stderr
    assert "Error writing persistent compilation cache" not in out.stderr, out.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["compile"], out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("max_bytes", [None, 2**30])
def test_a_second_run_loads_every_program_and_compiles_none(tmp_path, max_bytes):
    cache = str(tmp_path / "cache")
    first, printed = _train(tmp_path / "first", cache, max_bytes=max_bytes)
    # Within a run a program met twice (the same computation in two jitted functions) loads too.
    compiled = first["programs"] - first["programs_loaded"]
    assert compiled > 10 and first["programs_loaded"] < 5 and first["run_seconds"] > 0
    assert f"{compiled} programs compiled, {first['programs_loaded']} loaded from the compile cache in {cache}" in printed
    assert os.listdir(cache)
    second, printed = _train(tmp_path / "second", cache, max_bytes=max_bytes)
    assert second["programs"] == second["programs_loaded"] == first["programs"], (first, second)
    assert f"0 programs compiled, {first['programs']} loaded from the compile cache in {cache}" in printed
    if max_bytes is None:  # a directory written without a bound cannot take one: one line, exit 2
        said = _train(tmp_path / "third", cache, max_bytes=2**30, returncode=2).strip().splitlines()
        assert len(said) == 1 and "written without a bound" in said[0], said


def test_a_bound_refuses_a_directory_written_without_one(tmp_path, monkeypatch):
    import jax

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "jit_f-0123-cache").write_bytes(b"x")  # a program JAX wrote with no bound: no -atime file
    before = jax.config.jax_compilation_cache_dir
    with pytest.raises(ValueError, match="bound of 1024 bytes .* 1 of its programs were written without a bound"):
        enable(CompileCacheConfig(dir=str(cache), max_bytes=1024))
    with pytest.raises(ValueError, match="written without a bound"):  # a file:// URL is the same directory
        enable(CompileCacheConfig(dir=f"file://{cache}", max_bytes=1024))
    monkeypatch.setitem(compile_cache._JAX_OWN, "bound", 4096)  # JAX's own bound (its environment's) alike
    with pytest.raises(ValueError, match="bound of 4096 bytes"):
        enable(CompileCacheConfig(dir=str(cache)))
    assert jax.config.jax_compilation_cache_dir == before  # refused before anything changed


@pytest.mark.slow
def test_with_the_cache_off_every_run_compiles_everything(tmp_path):
    env_cache = tmp_path / "jax_env_cache"  # JAX's own setting, which dir=None overrides too
    # JAX's own settings would keep every program (the defaults skip those compiled in under 1 s).
    c, printed = _train(tmp_path / "run", None, env={"JAX_COMPILATION_CACHE_DIR": str(env_cache),
                                                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                                                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})
    assert c["programs"] > 10 and c["programs_loaded"] == 0, c
    assert "loaded from the compile cache (off)" in printed
    # Nothing was written anywhere, so a next run has nothing to load either.
    assert not env_cache.exists() or not any(env_cache.iterdir())


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert CompileCacheConfig().resolved_dir() == str(tmp_path / "jax")  # JAX's own setting first
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert CompileCacheConfig().resolved_dir() == str(tmp_path / "xdg" / "tpurl" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert CompileCacheConfig().resolved_dir() == str(tmp_path / "home" / ".cache" / "tpurl" / "jax")
    assert CompileCacheConfig(dir="~/c").resolved_dir() == str(tmp_path / "home" / "c")
    assert CompileCacheConfig(dir=None).resolved_dir() is None
    assert CompileCacheConfig(dir="gs://bucket/cache").resolved_dir() == "gs://bucket/cache"  # a URL as given


@pytest.mark.parametrize("kwargs,message", [
    (dict(dir=" "), "CompileCacheConfig.dir is empty"), (dict(max_bytes=0), "CompileCacheConfig.max_bytes=0")])
def test_bad_cache_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompileCacheConfig(**kwargs)


@pytest.mark.parametrize("field, change", [("compile_cache", dict(compile_cache=CompileCacheConfig(dir=None))),
                                           ("compile_ahead", dict(compile_ahead=True))])
def test_resuming_with_another_compile_setting_is_allowed(field, change):
    saved = config_record(RLConfig())
    said = []
    check_resume_config(saved, config_record(RLConfig(**change)), step=3, say=said.append)
    assert len(said) == 1 and field in said[0]
