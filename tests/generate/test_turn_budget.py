"""The scheduler at the edge of the token budget, with a scripted engine (the model's tokens are
fixed in advance, so the turn that ends on the budget's last token can be chosen): the environment
still sees that turn, so an answer given with the last token is graded, and a tool call made with
it ends the episode as `length` with its pages given back."""

import types

import numpy as np
import pytest

from tpurl.generate import driver
from tpurl.generate.page_book import Detached
from tpurl.generate.protocol import ResultTokens
from tpurl.generate.sampling import SamplingConfig
from tpurl.rl.batch import pack_rollouts
from tpurl.rl.rollout import _Turns
from tpurl.tasks.calculator import CalculatorConfig, CalculatorEnv
from tpurl.tasks.env import episode_for


class _Prefix:
    def __init__(self, first):
        self.k, self.first_tokens, self.first_logprobs, self.first_top = None, np.array([first]), np.zeros(1), None
        self.routes = None  # no router replay

    def finished_at_first_token(self, k):
        return False


class _ScriptedEngine:
    """One slot, pages never short; every token the 'model' samples comes from `script`."""

    max_concurrent_decodes, replicas, paged = 1, 1, True
    config = types.SimpleNamespace(max_prefill_batch=1)

    def __init__(self, script, eos):
        self.script, self.eos, self.i = script, eos, 1
        self.detached, self.released = 0, 0

    def replica_of(self, slot): return 0
    def free_pages(self, replica): return 100
    def pages_needed(self, prefix, n, replica): return n
    def request_pages(self, *a): return 1
    def check_request(self, *a): pass
    def check_sampling(self, sampling): pass
    def reports_top(self, sampling): return 0
    def prefill_batch(self, params, prompts, sampling, seeds): return [(_Prefix(self.script[0]), None)]
    def release_prefix(self, prefix): pass
    def free_resource(self, slot): pass

    def detach(self, slot):
        self.detached += 1
        return Detached(0, [1], 0)

    def release_detached(self, seq):
        self.released += 1


class _ScriptedPool:
    def __init__(self, engine):
        self.engine = engine

    def insert_batch(self, requests): pass

    def _next(self):  # the next scripted token; EOS ends the sequence on device
        e = self.engine
        token, e.i = e.script[e.i], e.i + 1
        return ResultTokens(tokens=np.array([token]), logprobs=np.zeros(1), valid=np.array([True]), lengths=None,
                            done=np.array([token == e.eos]))

    def step(self, params, **_): return self._next()
    def extend(self, params, requests, sampling): return self._next()


def _run(env, model_text, budget):
    """`model_text`: the model's turns (EOS appended after a final answer); each call's result
    `4042|` (5 tokens) is the environment's and counts toward `budget` too."""
    tok, problem = env.tokenizer, env.make_problem(47, 86)
    script = tok.encode(model_text) + ([] if model_text.endswith("]") else [tok.eos_id])
    results = model_text.count("]") - model_text.endswith("]")  # a last call's result would not fit
    assert len(script) + 5 * results == budget  # the last turn ends on the budget's last token
    engine = _ScriptedEngine(script, tok.eos_id)
    episodes = [[episode_for(env, problem)]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=budget, stop_token_ids=(tok.eos_id,),
                              stop_strings=env.stop_strings)
    out = driver.generate(engine, None, [env.encode_prompt(problem)], n_samples=1, sampling=sampling, seed=0,
                          tokenizer=tok, pool=_ScriptedPool(engine), on_turn_end=_Turns(tok, episodes))
    return engine, out[0][0], pack_rollouts(env, [problem], out, 64, None, episodes)


@pytest.fixture(scope="module")
def env():
    return CalculatorEnv(CalculatorConfig(digits=2))


def test_an_answer_on_the_last_token_is_graded(env):
    # Two calls, their results and the answer use the task's 29 tokens exactly (its budget is
    # sized for that).
    assert env.max_new_tokens == 29
    engine, completion, ro = _run(env, "[47*86][47*86]4042", env.max_new_tokens)
    assert completion.finish_reason == "stop" and completion.turns == 3
    assert ro.components["correct"][0, 0] == 1.0 and ro.components["tool_calls"][0, 0] == 2.0
    # Each turn's end detached the sequence; two resumed into a slot, the last one's pages came back.
    assert ro.infos[0]["turns"] == 3 and (engine.detached, engine.released) == (3, 1)


def test_a_call_on_the_last_token_ends_the_episode_as_length(env):
    engine, completion, ro = _run(env, "[47*86][47*86]", 7 + 5 + 7)  # no room for the second result
    assert completion.finish_reason == "length" and ro.components["correct"][0, 0] == 0.0
    assert ro.components["tool_calls"][0, 0] == 2.0  # the environment saw the last call
    assert (engine.detached, engine.released) == (2, 1)  # the waiting sequence's pages came back
