"""The host records of a running sequence: the top logprobs each token keeps."""

import pytest

from tpurl.generate.records import Running


def _running(top_count: int) -> Running:
    return Running(0, 0, [], [], [], [], top_count=top_count)


def test_a_sequence_keeps_its_requests_count_of_top_logprobs():
    """A program computes the engine's count (3 here); a request that asked for 2 keeps 2 per
    sampled token, None per environment token; one that asked for none keeps no list at all."""
    run = _running(2)
    run.append(7, -0.1, 0, ([7, 4, 9], [-0.1, -2.0, -3.0]))
    run.observe([5, 6])
    run.append(4, -0.5, 1, ([4, 7, 1], [-0.5, -1.0, -4.0]))
    assert run.top == [([7, 4], [-0.1, -2.0]), None, None, ([4, 7], [-0.5, -1.0])]
    plain = _running(0)
    plain.append(7, -0.1, 0, ([7, 4, 9], [-0.1, -2.0, -3.0]))
    plain.append(4, -0.5, 0, None)
    assert plain.top is None and plain.tokens == [7, 4]


def test_a_token_without_the_top_logprobs_its_sequence_reports_is_an_error():
    """A sequence that reports top logprobs read from a program that computed none: a wrong program
    choice, raised rather than recorded as a token without alternatives."""
    run = _running(2)
    with pytest.raises(ValueError, match="came from a program that computed none"):
        run.append(7, -0.1, 0, None)
    assert run.tokens == [] and run.top == []  # nothing half-appended
    with pytest.raises(ValueError, match="top logprobs kept for a sequence whose top_count is 0"):
        Running(0, 0, [], [], [], [], top=[], top_count=0)
