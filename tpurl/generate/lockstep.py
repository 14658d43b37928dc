"""A `Service` across processes: process 0 takes the requests, every process runs the same batch.

In a multi-process run the engine's programs span every process's devices, so every process must
run the same rounds with the same requests in the same order (SPMD). Only process 0 takes
requests (its endpoint, its agents). Before each round it takes the commands queued since the
last one, as a single-process service would, and sends them to every process over the engine's
devices (`tpurl.sharding.host.on_writer`, `shared_round`); each process then applies the same
commands in the same order: submits and cancels, and whether the service goes on. The other
processes' tickets stand in for process 0's: they carry no callbacks and nobody waits on them.
Reads of the engine's state (`Service.call`) stay on process 0.

The exchange runs on the engine's devices, so a round waits there for the decode step in flight:
across processes the service's decode steps are not pipelined.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable

import numpy as np

from tpurl.generate.sampling import SamplingConfig
from tpurl.sharding.host import is_writer, on_writer


def shared_round(take: Callable[[list], bool], mesh, tickets: dict[int, Any], make_ticket
                 ) -> tuple[bool, list[tuple]]:
    """One round's commands on every process: process 0 runs `take(taken)` (it appends the submits
    and cancels it takes and says whether the service goes on) and sends them. Returns whether to
    go on and the commands to apply, in order: process 0's own; on the others, stand-ins made by
    `make_ticket(n, tid)` (`tickets`: this process's open tickets by id, to which each decoded
    submit is added, so that a cancel later in the same round finds it)."""
    taken: list[tuple] = []

    def send() -> dict[str, Any]:
        go = take(taken)
        return {"go": go, "commands": [encode(c) for c in taken]}

    shared = on_writer(send, mesh=mesh)
    return shared["go"], taken if is_writer() else decode_all(shared["commands"], tickets, make_ticket)


def decode_all(shared: list[dict[str, Any]], tickets: dict[int, Any], make_ticket) -> list[tuple]:
    """A round's commands on another process, in order (see `shared_round`)."""
    commands = []
    for c in shared:
        commands.append(decode(c, tickets, make_ticket))
        if c["kind"] == "submit":
            tickets[c["tid"]] = commands[-1][1]
    return commands


def encode(command: tuple) -> dict[str, Any]:
    """A submit or cancel command as JSON (its ticket by id)."""
    if command[0] == "submit":
        _, ticket, ids, sampling, seeds, session = command
        return {"kind": "submit", "tid": ticket.tid, "n": ticket.n, "ids": np.asarray(ids).tolist(),
                "sampling": dataclasses.asdict(sampling), "seeds": [int(s) for s in seeds], "session": session}
    if command[0] == "cancel":
        return {"kind": "cancel", "tid": command[1].tid}
    raise ValueError(f"lockstep.encode: a {command[0]!r} command is not shared between processes")


def decode(shared: dict[str, Any], tickets: dict[int, Any], make_ticket) -> tuple:
    """The command `encode` made, on another process: a submit with a stand-in ticket
    (`make_ticket(n, tid)`), a cancel of the ticket of that id in `tickets`."""
    if shared["kind"] == "submit":
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in shared["sampling"].items()}
        return ("submit", make_ticket(shared["n"], shared["tid"]), np.asarray(shared["ids"], np.int32),
                SamplingConfig(**fields), shared["seeds"], shared["session"])
    ticket = tickets.get(shared["tid"])
    return ("cancel", ticket if ticket is not None else make_ticket(1, shared["tid"]),
            concurrent.futures.CancelledError())
