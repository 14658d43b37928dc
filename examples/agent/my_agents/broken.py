"""An agent that fails after its first call: its episodes get zero reward and the error in their
trajectories (a test of tpurl's containment, not an example to follow)."""


async def solve(client, problem):
    await client.completions.create(model="policy", prompt=problem.prompt, max_tokens=4)
    return 1 / 0
