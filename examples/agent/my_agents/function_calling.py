"""A calculator agent through OpenAI function calling: the chat completions API with a `multiply`
tool; the model calls it, the agent runs it and sends the result back as a `tool` message, and the
model's next message is the answer. Plain OpenAI API code (`openai.AsyncOpenAI`); tpurl serves it
from the policy being trained (`CalculatorConfig.chat=True`: the calculator in a chat format) and
trains on exactly the tokens the model sampled."""

import json

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "The product of two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


async def solve(client, problem) -> dict[str, float]:
    """Up to two rounds of tool calls, then the answer; the reward says whether it is the product."""
    messages = [{"role": "user", "content": problem.prompt}]  # "47*86="
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break  # the answer (or a turn cut off): the episode is over
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            result = args["a"] * args["b"] if call.function.name == "multiply" else "?"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return {"correct": float(message.content == problem.answer)}
