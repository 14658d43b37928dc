"""Shared check for preset folders whose gin files each define a gin scope named after the file."""

from pathlib import Path

import gin

from tpurl.commands.gin_config import parse_gin

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def assert_scoped_gin_files_equal_presets(folder: str, configurable: str, presets, lookup) -> None:
    """Every `configs/<folder>/<name>.gin` binds `<name>/<configurable>` to exactly `lookup(name)`,
    and the files are exactly the Python `presets`."""
    files = sorted((CONFIGS / folder).glob("*.gin"))
    assert {f.stem for f in files} == set(presets)
    parse_gin([str(f) for f in files])
    try:
        make = gin.get_configurable(configurable)
        for f in files:
            with gin.config_scope(f.stem):
                assert make() == lookup(f.stem), f.name
    finally:
        gin.clear_config()
