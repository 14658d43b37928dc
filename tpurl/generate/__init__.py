"""Rollout engine: paged KV cache, JetStream-style engine protocol, continuous batching, sampling."""

from tpurl.generate.allocator import PageAllocator, PoolExhausted
from tpurl.generate.driver import Completion, generate
from tpurl.generate.engine import Engine, EngineConfig, Prefix, ResultTokens
from tpurl.generate.pool import KVPool
from tpurl.generate.sampling import SamplingConfig, request_seed

__all__ = ["Completion", "Engine", "EngineConfig", "KVPool", "PageAllocator", "PoolExhausted", "Prefix", "ResultTokens",
           "SamplingConfig", "generate", "request_seed"]
