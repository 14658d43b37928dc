"""What a weight sync is told (`SyncConfig`) and what it reports (`SyncReport`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from tpurl.config_types import check_types
from tpurl.models.quant import check_format

METHODS = ("auto", "device_put", "jit", "permute")
ADAPTER_FORMS = ("auto", "merged", "unmerged")  # SyncConfig.adapters: see tpurl.sync.lora


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How weights move from the train layout to the rollout layout.

    `method`: "device_put", "jit", "permute", or "auto" (permute when disjoint train and rollout
    pools hold devices of more than one process; device_put across disjoint meshes of one process; otherwise
    measure device_put and jit once per backend and keep the faster). `bucket_bytes`: the most
    bytes (at the rollout dtype) moved between two host synchronizations, which bounds the sync's
    extra device memory.
    `rollout_dtype`: dtype of floating-point rollout params, cast inside the sync (e.g.
    "bfloat16": half the bytes of fp32 masters); None keeps each leaf's dtype.
    `adapters`: how a LoRA model reaches the rollout (`tpurl.sync.lora`): "merged" (the engine
    runs the plain model on merged weights), "unmerged" (the engine adds the adapters' low-rank
    path; each sync moves only the adapters) or "auto" (merged when train and rollout share their
    devices, unmerged when the weights cross to others).
    `quantize`: None, or "fp8": the rollout's layer projections and experts in float8 e4m3 with
    per-channel scales, quantized inside the sync (`tpurl.sync.quantize`; bf16 or fp32 training
    unchanged); the rollout engine then runs the quantized model.
    """

    method: str = "auto"
    bucket_bytes: int = 256 * 2**20
    rollout_dtype: str | None = None
    adapters: str = "auto"
    quantize: str | None = None

    def __post_init__(self):
        check_types(self)
        check_format(self.quantize, "SyncConfig.quantize")
        if self.method not in METHODS:
            raise ValueError(f"SyncConfig.method={self.method!r}; use one of {METHODS}")
        if self.adapters not in ADAPTER_FORMS:
            raise ValueError(f"SyncConfig.adapters={self.adapters!r}; use one of {ADAPTER_FORMS}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"SyncConfig.bucket_bytes={self.bucket_bytes} must be positive (e.g. 256 MiB)")
        if self.rollout_dtype is not None:
            try:
                dt = jnp.dtype(self.rollout_dtype)
            except TypeError:
                raise ValueError(f"SyncConfig.rollout_dtype={self.rollout_dtype!r} is not a dtype name; "
                                 "use e.g. 'bfloat16' or None") from None
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"SyncConfig.rollout_dtype={self.rollout_dtype!r} must be a floating dtype")

    def copies_every_leaf(self, param_dtype) -> bool:
        """Whether every sync of `param_dtype` weights copies every leaf (a cast to another dtype), so
        no rollout weight aliases a train weight. Without a cast, leaves whose shardings coincide
        in both layouts (e.g. replicated norms) are passed through, and identical layouts make
        the whole sync free."""
        dt = self.rollout_dtype
        return dt is not None and jnp.dtype(dt) != jnp.dtype(param_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncReport:
    """What one sync did. `bytes_moved`: global bytes (at the rollout dtype) of the leaves that were
    copied; `leaves_resharded`: leaves copied (for a new layout, a new dtype or both), of which
    `leaves_relaid` changed layout; `leaves_unchanged`: passed through as they were; `free`:
    nothing was copied (layouts and dtypes coincide); `max_bucket_bytes`: the largest bucket, i.e.
    the bound on temporaries in flight."""

    method: str
    bytes_moved: int
    leaves_resharded: int
    leaves_relaid: int
    leaves_unchanged: int
    buckets: int
    max_bucket_bytes: int
    seconds: float
    free: bool

    @staticmethod
    def combined(reports) -> SyncReport | None:
        """Several syncs reported as one (a step that ran more than one): counts, bytes and seconds
        summed, the largest bucket, free only if all were, the last one's method; None for none."""
        reports = [r for r in reports if r is not None]
        if len(reports) <= 1:
            return reports[0] if reports else None
        total = {f: sum(getattr(r, f) for r in reports) for f in
                 ("bytes_moved", "leaves_resharded", "leaves_relaid", "leaves_unchanged", "buckets", "seconds")}
        return dataclasses.replace(reports[-1], **total, max_bucket_bytes=max(r.max_bucket_bytes for r in reports),
                                   free=all(r.free for r in reports))
