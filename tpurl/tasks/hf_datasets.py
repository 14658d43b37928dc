"""Rows from Hugging Face `datasets` data on local disk: a directory written by `save_to_disk` (a
`Dataset` or a `DatasetDict` of splits), a `.parquet` or `.arrow` file, or a `.json`/`.csv` file
read through `datasets`. `datasets` is an optional extra (`pip install 'tpurl[datasets]'`),
imported only when such data is read, with the hub switched off: tpurl reads local data only, and
a name that is not a local path is a one-line error saying to pass one.
"""

from __future__ import annotations

import os

# The file types `datasets` reads by builder name.
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".csv": "csv"}


def is_dataset_path(path: str) -> bool:
    """Whether `path` is read through `datasets` (a saved dataset directory or a BUILDERS file)."""
    return os.path.isdir(path) or os.path.splitext(path)[1].lower() in BUILDERS


def _datasets(owner: str):
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local data only: never reach for the hub
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{owner}: reading a Hugging Face dataset needs the datasets library; "
                         "pip install 'tpurl[datasets]'") from None
    return datasets


def _split(data, path: str, split: str | None, owner: str, field: str):
    """The split `split` of a DatasetDict (its only one when None), or the Dataset itself."""
    if not hasattr(data, "keys"):  # one Dataset: no splits to choose from
        if split is not None and field == "eval_split":  # the held-out rows would be the training rows
            raise ValueError(f"{owner}.eval_split={split!r}: {path} is one dataset without splits; set "
                             f"{owner}.eval_file or leave eval_split None")
        return data
    names = sorted(data.keys())
    if split is None and len(names) == 1:
        return data[names[0]]
    if split not in data:
        raise ValueError(f"{owner}.{field}={split!r}: {path} has the splits {names}; name one of them")
    return data[split]


def load_rows(path: str, split: str | None, owner: str, field: str) -> list[dict]:
    """The rows of the local dataset at `path` (split `split` where it has several; `field` is
    the config field naming the split, for errors)."""
    datasets = _datasets(owner)
    try:
        if os.path.isdir(path):
            data = datasets.load_from_disk(path)
        else:
            builder = BUILDERS[os.path.splitext(path)[1].lower()]
            data = datasets.load_dataset(builder, data_files=path, split="train")
    except FileNotFoundError as e:
        raise ValueError(f"{owner}: {path} is not a dataset saved with save_to_disk ({e}); pass that directory or a "
                         ".jsonl / .parquet / .arrow file") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: one line naming it
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{owner}: {path} could not be read as a dataset: {type(e).__name__}: {first}") from None
    return [dict(row) for row in _split(data, path, split, owner, field)]
