"""`tpurl.generate.lockstep`: the commands process 0 sends are, on another process, the same
submits (ids, sampling, seeds, session) and cancels, in order; a cancel finds the ticket of a
submit sent in the same round (tests/rl/test_multiprocess_agent.py runs two processes)."""

import concurrent.futures

import numpy as np

from tpurl.generate import SamplingConfig
from tpurl.generate.lockstep import decode_all, encode
from tpurl.generate.service import Ticket

SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=9, stop_token_ids=(2, 5), stop_strings=("]",))


def test_a_round_decodes_to_the_same_commands_and_tickets():
    sent = [("submit", Ticket(2, None, tid=7), np.asarray([3, 4, 5], np.int32), SAMPLING, [11, 12], "p0s1"),
            ("cancel", Ticket(1, None, tid=3)), ("submit", Ticket(1, None, tid=8), np.asarray([6], np.int32),
                                                    SAMPLING, [13], None), ("cancel", Ticket(1, None, tid=8))]
    open_before = {3: Ticket(1, None, tid=3)}
    got = decode_all([encode(c) for c in sent], dict(open_before), lambda n, tid: Ticket(n, None, tid=tid))
    assert [c[0] for c in got] == ["submit", "cancel", "submit", "cancel"]
    submit = got[0]
    assert (submit[1].tid, submit[1].n, submit[2].tolist(), submit[3], submit[4], submit[5]) == (
        7, 2, [3, 4, 5], SAMPLING, [11, 12], "p0s1")
    assert got[1][1] is open_before[3]  # an open ticket of an earlier round
    assert got[3][1] is got[2][1]  # the cancel of a submit of the same round: that submit's ticket
    assert isinstance(got[3][2], concurrent.futures.CancelledError)
