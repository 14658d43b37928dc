"""A calculator agent: the model may call the calculator by writing `[a*b]`; the agent evaluates
the call, sends the result back, and the model's next turn is its answer. Plain OpenAI API code
(`openai.AsyncOpenAI`, the completions endpoint); tpurl serves it from the policy being trained
and trains on exactly the tokens the model sampled."""

import re

CALL = re.compile(r"\[(\d{1,6})\*(\d{1,6})$")  # the call, up to the stop string "]"


async def solve(client, problem) -> dict[str, float]:
    """Up to two tool calls, then the answer; the reward says whether it is the product."""
    text = problem.prompt  # "47*86="
    for _ in range(3):
        response = await client.completions.create(model="policy", prompt=text, stop=["]"])
        choice = response.choices[0]
        text += choice.text
        call = CALL.search(choice.text)
        if choice.finish_reason != "stop" or call is None:
            break  # an answer (or a turn cut off): the episode is over
        a, b = int(call.group(1)), int(call.group(2))
        text += f"]{a * b}|"  # the call's end, the tool's answer and its end marker
    answer = text.rsplit("|", 1)[-1] if "|" in text else text[len(problem.prompt):]
    return {"correct": float(answer == problem.answer)}
