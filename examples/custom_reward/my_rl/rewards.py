"""Reward functions of your own for tpurl's `custom` task, named by import path
(`CustomConfig.reward_fn = "my_rl.rewards:exact_and_brief"`). Each gets the filled prompt, the
completion's text and the row of the data it came from."""

from __future__ import annotations

import asyncio
import re


def exact_and_brief(prompt: str, completion: str, row: dict) -> dict[str, float]:
    """`correct`: the completion's last line is the row's answer; `brief`: it says no more than
    twice the answer's length. The components are named in `CustomConfig.reward_weights`."""
    lines = completion.strip().splitlines()
    last = lines[-1].strip() if lines else ""
    return {"correct": float(last == row["answer"]),
            "brief": float(len(completion) <= 2 * len(row["answer"]) + 8)}


async def contains_answer(prompt: str, completion: str, row: dict) -> float:
    """An async reward (one that awaits a grading service has this form): whether the answer
    appears as a whole word. tpurl runs it to completion on its own event loop, with the timeout."""
    await asyncio.sleep(0)
    return float(re.search(rf"\b{re.escape(row['answer'])}\b", completion) is not None)


def exact_batch(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """A batched reward (`CustomConfig.batched = True`): one call for the whole step's samples."""
    return [float(c.strip() == r["answer"]) for c, r in zip(completions, rows)]
