"""Gin registration of tpurl's typed configs. Only entry points (the CLI, scripts) call
`parse_gin`; library code receives the frozen dataclasses as arguments and never reads gin."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import tokenize
from typing import Sequence

import gin

from tpurl.checkpoint import CheckpointConfig
from tpurl.compile_cache import CompileCacheConfig
from tpurl.generate import EngineConfig, SamplingConfig
from tpurl.logging import LoggingConfig, MlflowConfig, WandbConfig
from tpurl.models.config import ModelConfig, RopeScaling, preset
from tpurl.models.lora import LoraConfig
from tpurl.models.moe import MoeConfig
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.sandbox import SandboxConfig
from tpurl.sharding.distributed import DistributedConfig
from tpurl.sharding.layout import Layout, MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.sync import HandoverConfig, SyncConfig
from tpurl.tasks import (AdditionConfig, AgentConfig, CalculatorConfig, CodeConfig, CustomConfig, EpisodeLimits,
                         MathConfig, PythonToolConfig, TaskConfig)
from tpurl.train.config import AlgorithmConfig, OptimizerConfig, algorithm_preset
from tpurl.train.correction import CorrectionConfig, correction_preset
from tpurl.train.packing import PackingConfig

_REGISTERED = False
CONFIG_CLASSES = (ModelConfig, RopeScaling, LoraConfig, MoeConfig, MeshConfig, Layout, SyncConfig, HandoverConfig,
                  PlacementConfig, RLConfig, AsyncConfig, SFTConfig, EvalConfig, TaskConfig, AdditionConfig, MathConfig,
                  CodeConfig, CustomConfig, SandboxConfig, CalculatorConfig, PythonToolConfig, AgentConfig, EpisodeLimits,
                  LoggingConfig, WandbConfig, MlflowConfig, CheckpointConfig, AlgorithmConfig, CorrectionConfig,
                  OptimizerConfig, EngineConfig, SamplingConfig, PackingConfig, DistributedConfig, CompileCacheConfig)


def register() -> None:
    """Make the config dataclasses (and a few factories) bindable from gin files. Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    for obj in CONFIG_CLASSES:
        gin.external_configurable(obj, module="tpurl")
    gin.external_configurable(preset, name="model_preset", module="tpurl")
    gin.external_configurable(algorithm_preset, name="algorithm_preset", module="tpurl")
    gin.external_configurable(correction_preset, name="correction_preset", module="tpurl")
    _REGISTERED = True


def parse_gin(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> None:
    """Parse gin files and `A.b=c` bindings (clearing any earlier config first). A file that cannot
    be read or parsed is a one-line ValueError naming the file and line (or the binding)."""
    register()
    gin.clear_config()
    bindings = list(bindings)
    try:
        with _no_gin_path_log(), _no_include_cycles():
            gin.parse_config_files_and_bindings(list(files), bindings)
    except SyntaxError as e:  # gin reports bad syntax as a SyntaxError carrying the location
        where = (f"{e.filename}:{e.lineno}" if e.filename else _binding(bindings, e.lineno))
        text = (e.text or "").strip() or _binding(bindings, e.lineno, quoted=False)
        raise ValueError(f"gin syntax error in {where}: {e.msg.rstrip('.')}: {text!r}") from None
    except tokenize.TokenError as e:  # unbalanced brackets
        raise ValueError(f"gin syntax error: {e.args[0]} (an unclosed bracket or quote) in "
                         f"{', '.join(list(files) + [repr(b) for b in bindings])}") from None
    except ImportError as e:  # a gin `import` statement (gin adds where it is to the message)
        raise ValueError(f"gin import failed: {_with_location(str(e), bindings)}; install the module or remove "
                         "the import") from None
    except RecursionError:  # include cycles are caught before this: a value nested thousands deep
        where = ", ".join(list(files) + [repr(b if len(b) <= 60 else b[:57] + "...") for b in bindings])
        raise ValueError(f"gin value nested too deeply to parse in {where}; write it flatter") from None
    except (ValueError, OSError) as e:
        raise ValueError(_with_location(str(e), bindings)) from None


def check_bindings_used() -> None:
    """After the entry point has built its configs: a ValueError when a configurable has bindings
    but was never called, i.e. nothing references it (`tpurl.PackingConfig.enabled=False` without
    `tpurl.RLConfig.packing = @tpurl.PackingConfig()` would otherwise be silently ignored). Reads
    gin's record of what was bound and what was called (`gin.config`'s `_CONFIG`, `_OPERATIVE_CONFIG`)."""
    bound = getattr(gin.config, "_CONFIG", {})
    called = getattr(gin.config, "_OPERATIVE_CONFIG", {})
    for (scope, selector), params in bound.items():
        if not params or selector == "gin.macro" or _applied(scope, selector, called):
            continue
        name = f"{scope + '/' if scope else ''}{selector}"
        bindings = ", ".join(f"{name}.{p}" for p in sorted(params))
        raise ValueError(f"gin bindings {bindings} were never used: nothing references {name}; "
                         f"{_where_referenced(name)}")


def _applied(scope: str, selector: str, called) -> bool:
    """Whether a binding of `selector` in `scope` reached a call: gin applies it to the calls in
    that scope and in the scopes nested under it (an unscoped binding to every call)."""
    return any(s == selector and (not scope or c == scope or c.startswith(scope + "/")) for c, s in called)


def _where_referenced(name: str) -> str:
    """How to reference the configurable `name` (scope/selector): the config fields of its type."""
    cls_name = name.rsplit(".", 1)[-1]
    fields = [f"tpurl.{cls.__name__}.{f.name} = @{name}()" for cls in CONFIG_CLASSES
              for f in dataclasses.fields(cls) if str(f.type).split(" |")[0].strip() == cls_name]
    if fields:
        return "reference it, e.g. " + " or ".join(repr(f) for f in fields)
    return "reference it from the config that takes it (e.g. 'tpurl.RLConfig.<field> = @...()') or remove the binding"


@contextlib.contextmanager
def _no_gin_path_log():
    # gin logs a missing include ("Path not found: x.gin") before raising the error that says the
    # same thing; keep the error, the only line.
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Path not found")

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


@contextlib.contextmanager
def _no_include_cycles():
    """Make a gin file that includes itself, directly or through others, a one-line ValueError
    naming the cycle instead of a RecursionError. Gin keeps each file open while it parses it and
    the files it includes, so the files its readers (`gin.config._FILE_READERS`) have open at once
    are the chain of includes."""
    chain: list[str] = []
    readers = list(gin.config._FILE_READERS)

    def tracked(reader):
        @contextlib.contextmanager
        def read(path):
            real = os.path.realpath(path)
            if real in chain:
                cycle = " -> ".join(chain[chain.index(real):] + [real])
                raise ValueError(f"gin include cycle: {cycle}; remove one of these includes")
            chain.append(real)
            try:
                with reader(path) as f:
                    yield f
            finally:
                chain.pop()

        return read

    gin.config._FILE_READERS[:] = [(tracked(reader), readable) for reader, readable in readers]
    try:
        yield
    finally:
        gin.config._FILE_READERS[:] = readers


def _binding(bindings: list[str], lineno: int | None, *, quoted: bool = True) -> str:
    # gin parses the bindings as one string, one binding per line.
    if lineno is None or not 1 <= lineno <= len(bindings):
        return "--gin_param" if quoted else ""
    return f"--gin_param {bindings[lineno - 1]!r}" if quoted else bindings[lineno - 1]


def _with_location(message: str, bindings: list[str]) -> str:
    """Gin's multi-line message as one line: its first line and where (file:line or binding)."""
    lines = message.strip().splitlines()
    for line in lines[1:]:
        if m := re.search(r'In file "(.*)", line (\d+)', line):
            return f"{lines[0]} ({m[1]}:{m[2]})"
        if m := re.search(r"In bindings string line (\d+)", line):
            return f"{lines[0]} ({_binding(bindings, int(m[1]))})"
    return lines[0] if lines else message
