"""Every gin file shipped in configs/ parses against the registered configurables, and the model
presets name real entries of `tpurl.models.config.PRESETS`."""

import os
import pathlib

import gin
import pytest

from tpurl.commands.gin_config import parse_gin
from tpurl.models.config import PRESETS

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
ALL = sorted(CONFIGS.rglob("*.gin"))


@pytest.fixture(autouse=True)
def _clear_gin():
    yield
    gin.clear_config()


@pytest.mark.parametrize("path", ALL, ids=[str(p.relative_to(CONFIGS)) for p in ALL])
def test_gin_file_parses(path):
    parse_gin([str(path)])


@pytest.mark.parametrize("path", sorted((CONFIGS / "models").glob("*.gin")), ids=lambda p: p.stem)
def test_model_gin_names_a_preset(path):
    parse_gin([str(path)])
    name = gin.query_parameter("tpurl.RLConfig.model")
    assert name == path.stem and name in PRESETS


def test_unknown_binding_is_a_clear_error():
    with pytest.raises(ValueError, match="No configurable matching 'tpurl.RLConfig.no_such_field'|no_such_field"):
        parse_gin([], ["tpurl.RLConfig.no_such_field = 1"])


def test_an_unscoped_binding_that_reaches_scoped_calls_counts_as_used():
    """gin applies `tpurl.MeshConfig.axes` to `@train/tpurl.MeshConfig()` too: not an unused binding."""
    from tpurl.commands.train import build_config

    gin_dir = os.path.join(os.path.dirname(__file__), "..", "configs")
    cfg = build_config([os.path.join(gin_dir, "test_tiny.gin")], ["tpurl.MeshConfig.axes=('data', 'fsdp', 'tensor')"])
    assert cfg.placement.train_mesh.axes == ("data", "fsdp", "tensor")
