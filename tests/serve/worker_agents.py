"""Agents for worker processes (`AgentLimits.processes`): module-level, so that they pickle, and
light to import, as a worker imports this module to run them."""

import os


async def two_calls(client, problem):
    """Two completions calls, the second extending the first; reward: the tokens sampled."""
    first = await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=5, seed=11,
                                            extra_body={"ignore_eos": True})
    ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    second = await client.completions.create(model="policy", prompt=ids + ids[:2], max_tokens=4, seed=12,
                                             extra_body={"ignore_eos": True})
    return {"correct": float(len(second.choices[0].model_extra["token_ids"])), "prompt": float(len(problem.prompt)),
            "pid": float(os.getpid())}


async def dies_on_x(client, problem):
    """Ends its whole process on problem "x" (a native crash, an `os._exit` in a tool)."""
    if problem.uid == "x":
        os._exit(3)
    return await two_calls(client, problem)


async def echo(client, problem):
    """No call: the problem back as the reward, with the process that ran it and whether its event
    loop is uvloop's."""
    import asyncio

    uvloop = float(type(asyncio.get_running_loop()).__module__.startswith("uvloop"))
    return {"reward": float(problem), "pid": float(os.getpid()), "uvloop": uvloop}


async def exits(client, problem):
    """`sys.exit` inside an agent (a tool that calls it)."""
    raise SystemExit(f"tool gave up on {problem}")


async def blocks(client, problem):
    """On a problem that names a file: after a short await (the other episodes of its process end
    meanwhile), writes its process id there, then blocks its event loop for a minute (a
    synchronous call)."""
    import asyncio
    import time

    if problem != "ok":
        await asyncio.sleep(0.1)
        for _ in range(10):  # loop iterations too: the others' outcomes recorded whatever the timers did
            await asyncio.sleep(0)
        with open(problem, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    return {"reward": 1.0, "pid": float(os.getpid())}


async def dies_after_a_while(client, problem):
    """Ends its whole process (an `os._exit` in a tool) on problem "x", after a short await (the
    other episodes of its process end meanwhile)."""
    import asyncio

    if problem == "x":
        await asyncio.sleep(0.1)
        for _ in range(10):  # loop iterations too: the others' outcomes recorded whatever the timers did
            await asyncio.sleep(0)
        os._exit(3)
    return {"reward": 1.0}
