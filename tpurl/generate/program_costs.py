"""What the engine's compiled programs cost, from XLA's own analyses.

`ProgramCosts` is told which prefill shapes ran and which decode program is the widest compiled
so far, and answers on demand (asking XLA is not free, so nothing is analysed until asked and each
answer is kept): the FLOPs of every prefill forward run (`prefill_flops`), and the memory of the
widest decode program (`decode_memory`, per device).
"""

from __future__ import annotations

import collections

from tpurl.generate.prefill import forward_flops
from tpurl.memory import ProgramMemory, abstract, program_memory


class ProgramCosts:
    """XLA's cost and memory analyses of one engine's prefill and decode programs."""

    def __init__(self, graphdef, *, constrain, cache_dtype):
        self._graphdef, self._constrain, self._cache_dtype = graphdef, constrain, cache_dtype
        # Prefill programs run, by (prompts per call, bucket), and each shape's FLOPs once asked.
        self._prefill_calls: collections.Counter = collections.Counter()
        self._prefill_flops: dict[tuple[int, int], float] = {}
        # (width, abstract arguments, static arguments) of the widest decode program compiled, and its memory.
        self._decode_signature: tuple = (0, None, {})
        self._decode_memory: ProgramMemory | None = None

    def prefill_ran(self, prompts: int, bucket: int) -> None:
        """A prefill program of `[prompts, bucket]` ran."""
        self._prefill_calls[(prompts, bucket)] += 1

    def decode_compiled(self, width: int, args, statics: dict) -> None:
        """A decode program of `width` slots was compiled for `args` and `statics` (a call's
        arguments and static keyword arguments); kept if it is the widest yet (the latest of that width)."""
        if width >= self._decode_signature[0]:
            self._decode_signature = (width, abstract(args), dict(statics))
            self._decode_memory = None

    def prefill_flops(self, params) -> float:
        """Total FLOPs of the prefill forwards run so far (padding rows of a call included, the
        first-token sampling not), from XLA's cost analysis of each (prompts per call, bucket) shape."""
        total = 0.0
        for (p, bucket), calls in self._prefill_calls.items():
            if (p, bucket) not in self._prefill_flops:
                self._prefill_flops[(p, bucket)] = forward_flops(self._graphdef, params, p, bucket,
                                                                 constrain=self._constrain,
                                                                 cache_dtype=self._cache_dtype)
            total += calls * self._prefill_flops[(p, bucket)]
        return total

    def decode_memory(self, decode_jit) -> ProgramMemory | None:
        """XLA's memory analysis (per device) of the widest decode program of `decode_jit` compiled
        (the latest of that width: a top-k/top-p or top-logprobs variant compiled only at a narrower
        width is not the one reported); None before any decode step."""
        _, args, statics = self._decode_signature
        if args is not None and self._decode_memory is None:
            self._decode_memory = program_memory(decode_jit, *args, **statics)
        return self._decode_memory
