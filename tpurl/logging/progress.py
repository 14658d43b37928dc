"""Terminal progress bar (tqdm) showing the key numbers of each step."""

from __future__ import annotations

import sys
from typing import Mapping

from tqdm import tqdm

# metric key -> short label shown on the bar
DEFAULT_FIELDS = {"reward/total/mean": "reward", "eval/greedy_accuracy": "eval_acc", "train/kl": "kl",
                  "time/step_s": "s/step", "throughput/tokens_per_s": "tok/s"}


class Progress:
    """A tqdm bar over training steps; `update(metrics)` advances it and shows `fields`."""

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True, desc: str = "train",
                 fields: Mapping[str, str] = DEFAULT_FIELDS):
        self.fields = dict(fields)
        self._shown: dict[str, str] = {}
        self._bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, file=sys.stderr,
                         dynamic_ncols=True, leave=True)

    def update(self, metrics: Mapping[str, float], n: int = 1) -> None:
        for key, label in self.fields.items():
            if key in metrics and metrics[key] is not None:
                self._shown[label] = f"{float(metrics[key]):.4g}"
        self._bar.set_postfix(self._shown, refresh=False)
        self._bar.update(n)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        self._bar.write(line)

    def close(self) -> None:
        self._bar.close()
