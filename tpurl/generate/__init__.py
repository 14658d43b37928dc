"""Rollout engine: paged KV cache, JetStream-style engine protocol, continuous batching, sampling."""

from tpurl.generate.allocator import PageAllocator, PoolExhausted
from tpurl.generate.driver import generate
from tpurl.generate.engine import Engine, EngineConfig, Prefix, ResultTokens
from tpurl.generate.pool import KVPool
from tpurl.generate.records import Completion
from tpurl.generate.sampling import SamplingConfig, request_seed
from tpurl.generate.service import Service, ServiceClosed, Ticket
from tpurl.generate.weights import IN_FLIGHT_MODES, InFlight, Weights, WeightSlot

__all__ = ["Completion", "Engine", "EngineConfig", "IN_FLIGHT_MODES", "InFlight", "KVPool", "PageAllocator",
           "PoolExhausted", "Prefix", "ResultTokens", "SamplingConfig", "Service", "ServiceClosed", "Ticket",
           "WeightSlot", "Weights", "generate", "request_seed"]
