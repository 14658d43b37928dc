"""How an RL step cuts its batch into minibatches (`tpurl.rl.step.minibatch_order`)."""

import numpy as np

from tpurl.rl.step import minibatch_order


def test_minibatches_take_whole_groups_when_they_divide():
    rng = np.random.default_rng(0)
    order = minibatch_order(32, 4, 2, rng)  # 8 groups of 4 into 2 minibatches
    assert sorted(order) == list(range(32))
    for part in np.split(order, 2):
        groups = part.reshape(-1, 4) // 4
        assert (groups == groups[:, :1]).all()  # each run of 4 is one group, in order
        assert (part.reshape(-1, 4) % 4 == np.arange(4)).all()
    assert len({tuple(minibatch_order(32, 4, 2, np.random.default_rng(s))) for s in range(5)}) == 5  # shuffled
    rows = minibatch_order(24, 4, 4, rng)  # 6 groups do not split into 4 minibatches: rows shuffled
    assert sorted(rows) == list(range(24)) and not (rows == np.arange(24)).all()
    odd = minibatch_order(30, 4, 2, rng)  # rows that are not whole groups: rows shuffled
    assert sorted(odd) == list(range(30)) and not (odd == np.arange(30)).all()


def test_episodes_of_several_rows_stay_together():
    """Episodes of 2 rows (an agent's trained sequences): whole groups of 8 rows when they divide
    into the minibatches, else whole episodes, never an episode's rows apart."""
    rng = np.random.default_rng(0)
    for rows, group, minibatches in [(32, 8, 2), (48, 8, 4)]:  # 4 groups into 2; 6 groups do not split into 4
        order = minibatch_order(rows, group, minibatches, rng, episode_rows=2)
        assert sorted(order) == list(range(rows)) and not (order == np.arange(rows)).all()
        pairs = order.reshape(-1, 2)
        assert (pairs[:, 0] % 2 == 0).all() and (pairs[:, 1] == pairs[:, 0] + 1).all()
