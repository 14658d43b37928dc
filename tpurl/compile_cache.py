"""JAX's persistent compilation cache for a run: a second run of the same config loads its
programs from disk instead of compiling them again.

`CompileCacheConfig.dir`: "auto" (the default) is JAX's own `JAX_COMPILATION_CACHE_DIR` when the
environment sets it, else `$XDG_CACHE_HOME/tpurl/jax` (`~/.cache/tpurl/jax`); a path puts the
cache there; None turns it off. Every program is kept, however fast it compiled (a run makes
dozens of small ones). `max_bytes` None (the default) keeps JAX's own bound
(`JAX_COMPILATION_CACHE_MAX_SIZE`, unbounded unless set); a number of bytes has JAX evict the
least recently used programs past it. Eviction needs every program in the directory written with
a bound (JAX records last-use times only then), so `enable` refuses a bounded cache in a
directory holding programs written without one. A program
is looked up by its computation, the compile options, the devices and the JAX version, so a cache
is never used for a program it does not hold; tracing and lowering still run in every process
(`compile/seconds` counts them with the load). `tpurl train` enables it before the first compile
(a program calling `tpurl.rl.loop.run` itself calls `enable` to have it); `tpurl generate` and
`tpurl serve` do too, from their `--compile-cache` flag.

Across processes JAX writes entries from process 0 only, and every process reads them: processes
on one machine share the default directory, processes on several hosts need a `dir` all of them
see (a shared file system, or a `gs://` path) to load what process 0 compiled. The run's report
counts process 0's programs.
"""

from __future__ import annotations

import dataclasses
import os

from tpurl.config_types import check_types

AUTO = "auto"
# JAX's own compile cache bound (its environment's), as the process's first `enable` found it.
_JAX_OWN: dict[str, int] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileCacheConfig:
    """Where a run keeps its compiled programs (see the module docstring)."""

    dir: str | None = AUTO
    max_bytes: int | None = None

    def __post_init__(self):
        check_types(self)
        if self.dir is not None and not self.dir.strip():
            raise ValueError("CompileCacheConfig.dir is empty; give a directory, 'auto', or None to turn the cache off")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"CompileCacheConfig.max_bytes={self.max_bytes} must be positive "
                             "(bytes, e.g. 8589934592 for 8 GiB) or None for JAX's own bound")

    def resolved_dir(self) -> str | None:
        """The directory the cache lives in, or None when it is off."""
        if self.dir is None:
            return None
        if self.dir != AUTO:
            return _local_or_url(os.path.expanduser(self.dir))
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return _local_or_url(os.environ["JAX_COMPILATION_CACHE_DIR"])
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "tpurl", "jax")


def _local_or_url(path: str) -> str:
    """An absolute local path, or a URL (`gs://...`, which JAX's cache reads through epath) as given."""
    return path if "://" in path else os.path.abspath(path)


def enable(cfg: CompileCacheConfig) -> str | None:
    """Turn the cache on (or off) for this process as `cfg` says, before its first compile;
    returns the directory in use (None: off)."""
    import jax

    path = cfg.resolved_dir()
    _JAX_OWN.setdefault("bound", jax.config.jax_compilation_cache_max_size)  # before any `enable` set it
    bound = _JAX_OWN["bound"] if cfg.max_bytes is None else cfg.max_bytes
    if path is not None and bound != -1:
        _check_evictable(path, bound)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", path is not None)
    if path is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size", bound)
    return path


def _check_evictable(path: str, max_bytes: int) -> None:
    """Refuse a local cache directory whose programs JAX could not evict: one written without a
    bound has a `<key>-cache` file and no `<key>-atime` file, and every later write with a bound
    would fail on it (a warning per program, nothing kept)."""
    path = path.removeprefix("file://")
    if "://" in path or not os.path.isdir(path):  # a bucket is not listed here
        return
    names = set(os.listdir(path))
    unbounded = [n for n in names if n.endswith("-cache") and n[:-len("-cache")] + "-atime" not in names]
    if unbounded:
        raise ValueError(
            f"a compile cache bound of {max_bytes} bytes (CompileCacheConfig.max_bytes or JAX_COMPILATION_CACHE_MAX_SIZE) "
            f"cannot hold in {path}: {len(unbounded)} of its programs were written without a bound (no last-use "
            "times); unset the bound, or give a fresh CompileCacheConfig.dir")
