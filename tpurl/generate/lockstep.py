"""A `Service` across processes: process 0 takes the requests, every process runs the same batch.

In a multi-process run the engine's programs span every process's devices, so every process must
run the same rounds with the same requests in the same order (SPMD). Only process 0 takes
requests (its endpoint, its agents). Before each round it takes the commands queued since the
last one, as a single-process service would, and sends them to every process over the engine's
devices (`tpurl.sharding.host.on_writer`); each process then applies the same commands: submits
and cancels, and whether the service goes on. The other processes' tickets stand in for process
0's: they carry no callbacks and nobody waits on them. Reads of the engine's state (`Service.call`)
stay on process 0.

`encode` and `decode` turn a submit or cancel command into JSON and back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import numpy as np

from tpurl.generate.sampling import SamplingConfig


def encode(command: tuple) -> dict[str, Any]:
    """A submit or cancel command as JSON (its ticket by id)."""
    if command[0] == "submit":
        _, ticket, ids, sampling, seeds, session = command
        return {"kind": "submit", "tid": ticket.tid, "n": ticket.n, "ids": np.asarray(ids).tolist(),
                "sampling": dataclasses.asdict(sampling), "seeds": [int(s) for s in seeds], "session": session}
    if command[0] == "cancel":
        return {"kind": "cancel", "tid": command[1].tid}
    raise ValueError(f"lockstep.encode: a {command[0]!r} command is not shared between processes")


def decode(shared: dict[str, Any], open_tickets, make_ticket) -> tuple:
    """The command `encode` made, on another process: a submit with a stand-in ticket
    (`make_ticket(n, tid)`), a cancel of the open ticket of that id (`open_tickets`: the tickets
    this process has open)."""
    if shared["kind"] == "submit":
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in shared["sampling"].items()}
        return ("submit", make_ticket(shared["n"], shared["tid"]), np.asarray(shared["ids"], np.int32),
                SamplingConfig(**fields), shared["seeds"], shared["session"])
    ticket = next((t for t in open_tickets if t.tid == shared["tid"]), None)
    return ("cancel", ticket if ticket is not None else make_ticket(1, shared["tid"]),
            concurrent.futures.CancelledError())
