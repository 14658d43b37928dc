"""Gin registration of tpurl's typed configs. Only entry points (the CLI, scripts) call
`parse_gin`; library code receives the frozen dataclasses as arguments and never reads gin."""

from __future__ import annotations

from typing import Sequence

import gin

from tpurl.models.config import ModelConfig, RopeScaling, preset
from tpurl.sharding.layout import Layout, MeshConfig
from tpurl.sync import HandoverConfig, PlacementConfig, SyncConfig
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.rl.dynamic import DynamicSamplingConfig
from tpurl.checkpoint import CheckpointConfig
from tpurl.logging import LoggingConfig
from tpurl.train.config import AlgorithmConfig, OptimizerConfig, algorithm_preset
from tpurl.tasks import (AdditionConfig, CalculatorConfig, CodeConfig, EpisodeLimits, MathConfig, PythonToolConfig,
                         TaskConfig)
from tpurl.sandbox import SandboxConfig
from tpurl.generate import EngineConfig, SamplingConfig

_REGISTERED = False


def register() -> None:
    """Make the config dataclasses (and a few factories) bindable from gin files. Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    for obj in (ModelConfig, RopeScaling, MeshConfig, Layout, SyncConfig, HandoverConfig, PlacementConfig,
                RLConfig, SFTConfig, EvalConfig, TaskConfig, AdditionConfig, MathConfig, CodeConfig, SandboxConfig,
                CalculatorConfig, PythonToolConfig, EpisodeLimits, LoggingConfig, CheckpointConfig, DynamicSamplingConfig, AlgorithmConfig,
                OptimizerConfig, EngineConfig, SamplingConfig):
        gin.external_configurable(obj, module="tpurl")
    gin.external_configurable(preset, name="model_preset", module="tpurl")
    gin.external_configurable(algorithm_preset, name="algorithm_preset", module="tpurl")
    _REGISTERED = True


def parse_gin(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> None:
    """Parse gin files and `A.b=c` bindings (clearing any earlier config first)."""
    register()
    gin.clear_config()
    gin.parse_config_files_and_bindings(list(files), list(bindings))
