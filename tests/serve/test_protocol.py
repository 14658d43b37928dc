"""Requests as the engine sees them: the sampling config a request's fields make."""

import pytest

from tpurl.serve.protocol import ChatRequest, CompletionRequest, sampling_config

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("request_, top", [
    (ChatRequest(model="m", messages=USER), 0),
    (ChatRequest(model="m", messages=USER, logprobs=True), 0),
    (ChatRequest(model="m", messages=USER, logprobs=True, top_logprobs=3), 3),
    (CompletionRequest(model="m", prompt="hi"), 0),
    (CompletionRequest(model="m", prompt="hi", logprobs=0), 0),
    (CompletionRequest(model="m", prompt="hi", logprobs=4), 4),
])
def test_a_request_reports_the_top_logprobs_it_asks_for_and_no_more(request_, top):
    """The engine computes top logprobs only for a batch where some request reports them
    (`SamplingConfig.top_logprobs`), so a request that asks for none must say 0, not the default
    (None: all the engine computes)."""
    assert sampling_config(request_, max_tokens=8, stop_ids=(1,)).top_logprobs == top
