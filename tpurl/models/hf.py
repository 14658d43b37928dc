"""Hugging Face checkpoints: one import for loading and saving.

- `load_hf_config(dir)` / `load_hf_checkpoint(dir, config=..., shardings=...)`: `hf_import.py`
  (streams each device's shard of each tensor from safetensors; no full host copy).
- `save_hf_checkpoint(model, dir, max_shard_bytes=...)`: `hf_export.py` (atomic, sharded with an
  index when large, loadable by `transformers`).
- `config_from_hf` / `config_to_hf` and the tensor-name mapping: `hf_mapping.py`.
"""

from tpurl.models.hf_export import save_hf_checkpoint
from tpurl.models.hf_import import load_hf_checkpoint, load_hf_config
from tpurl.models.hf_mapping import UnsupportedCheckpointError, config_from_hf, config_to_hf

__all__ = ["load_hf_checkpoint", "load_hf_config", "save_hf_checkpoint", "config_from_hf", "config_to_hf",
           "UnsupportedCheckpointError"]
