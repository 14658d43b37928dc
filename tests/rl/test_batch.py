"""`Rollouts`, the one carrier of rollout data: packing scored completions, selecting and joining
whole groups (DAPO's refill), zeroing the loss of filler groups, and trajectory records derived
from the rollouts alone."""

import dataclasses

import numpy as np
import pytest

from tpurl.generate import Completion
from tpurl.rl.batch import Rollouts, pack_rollouts, trajectory_records
from tpurl.tasks import AdditionConfig, AdditionTask

G, T = 3, 12


@pytest.fixture(scope="module")
def task():
    return AdditionTask(AdditionConfig(digits=1, num_eval=4))


def _rollouts(task, first: int, num: int, rng, on_writer=None) -> Rollouts:
    """`num` groups of G random completions of training problems `first...`, packed and scored."""
    problems = [task.train_problem(first + i) for i in range(num)]
    completions = []
    for p, problem in enumerate(problems):
        prompt = np.asarray(task.encode_prompt(problem), np.int32)
        group = []
        for g in range(G):
            n = int(rng.integers(1, 4))
            ids = rng.integers(1, task.tokenizer.vocab_size, n).astype(np.int32)
            group.append(Completion(prompt_ids=prompt, token_ids=ids, logprobs=-rng.random(n).astype(np.float32),
                                    finish_reason="stop" if g % 2 else "length", prompt_index=p, sample_index=g,
                                    versions=np.full(n, first + p, np.int32)))
        completions.append(group)
    return pack_rollouts(task, problems, completions, T, group_ids=range(first, first + num), on_writer=on_writer)


def test_the_grades_come_from_the_writer(task):
    """`pack_rollouts(on_writer=...)`: the grading runs inside `on_writer` (in a multi-process run,
    on process 0 alone) and the batch takes the rewards, components and infos it returns, so every
    process packs process 0's grades even where its own grader would have scored otherwise."""
    rng = np.random.default_rng(0)
    graded_here = _rollouts(task, 0, 2, rng)
    calls = []

    def writer(fn):  # process 0's grades, as every process receives them (a JSON round trip)
        import json
        calls.append(1)
        shared = json.loads(json.dumps(fn()))
        shared["totals"] = [t + 10.0 for t in shared["totals"]]  # what process 0 scored, not this process
        shared["infos"] = [{"graded_by": 0} for _ in shared["infos"]]
        return shared

    shared = _rollouts(task, 0, 2, np.random.default_rng(0), on_writer=writer)
    assert calls == [1]
    np.testing.assert_array_equal(shared.rewards, graded_here.rewards + 10.0)
    assert all(np.array_equal(shared.components[k], graded_here.components[k]) for k in task.reward_components)
    assert shared.infos == [{"graded_by": 0}] * len(graded_here.infos)
    np.testing.assert_array_equal(shared.tokens, graded_here.tokens)


def _group(ro: Rollouts, p: int) -> dict:
    rows = slice(p * G, (p + 1) * G)
    return {"tokens": ro.tokens[rows], "loss_mask": ro.loss_mask[rows], "lp": ro.rollout_logprobs[rows],
            "versions": ro.token_versions[rows], "rewards": ro.rewards[p], "correct": ro.components["correct"][p], "texts": ro.texts[rows],
            "reasons": ro.finish_reasons[rows], "uid": ro.problems[p].uid, "id": int(ro.group_ids[p]),
            "lengths": (ro.prompt_lengths[rows], ro.completion_lengths[rows])}


def _same(a: dict, b: dict):
    for k in a:
        if isinstance(a[k], tuple):
            for x, y in zip(a[k], b[k]):
                np.testing.assert_array_equal(x, y)
        elif isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def test_take_and_concat_move_whole_groups(task):
    rng = np.random.default_rng(0)
    a, b = _rollouts(task, 0, 4, rng), _rollouts(task, 10, 3, rng)
    joined = Rollouts.concat([a.take([2, 0]), b.take(np.array([False, True, True])), a.take([3])])
    assert joined.num_groups == 5 and joined.tokens.shape == (5 * G, T)
    for p, (src, q) in enumerate([(a, 2), (a, 0), (b, 1), (b, 2), (a, 3)]):
        _same(_group(joined, p), _group(src, q))
    assert joined.num_tokens == sum(src.completion_lengths[q * G:(q + 1) * G].sum()
                                    for src, q in [(a, 2), (a, 0), (b, 1), (b, 2), (a, 3)])
    filler = a.take([1]).without_loss()
    assert filler.loss_mask.sum() == 0 and filler.tokens.sum() == a.take([1]).tokens.sum()
    with pytest.raises(ValueError, match="differ"):
        Rollouts.concat([a, dataclasses.replace(a.take([0]), tokens=np.zeros((G, T + 1), np.int32))])


def test_trajectory_records_come_from_the_rollouts_alone(task):
    ro = _rollouts(task, 5, 2, np.random.default_rng(1))
    adv = np.arange(2 * G, dtype=np.float32)
    records = trajectory_records(ro, adv)
    assert [r["group_id"] for r in records] == [5] * G + [6] * G
    for b, r in enumerate(records):
        p, g = divmod(b, G)
        assert r["sample_index"] == g and r["problem_uid"] == ro.problems[p].uid
        assert r["prompt_ids"] == task.encode_prompt(ro.problems[p])
        n_p, n_g = len(r["prompt_ids"]), len(r["completion_ids"])
        assert r["prompt_ids"] + r["completion_ids"] == ro.tokens[b, :n_p + n_g].tolist()
        assert ro.loss_mask[b].sum() == n_g and r["completion"] == ro.texts[b]
        assert (ro.token_versions[b] == np.where(ro.sampled[b], 5 + p, -1)).all()
        assert r["finish_reason"] == ro.finish_reasons[b] and r["advantage"] == b
        assert r["reward"] == ro.rewards[p, g] and set(r["rewards"]) == set(task.reward_components)


def test_episodes_of_several_rows(task):
    """`rows_per_episode` = 2 (an agent episode training two sequences): row `(p * G + g) * 2 + s`
    is sequence s of episode (p, g); each episode is graded once, on its first row; `take` and
    `concat` move a group's rows together; trajectory records skip the rows without a sequence."""
    rng = np.random.default_rng(2)
    a = _rollouts(task, 0, 3, rng)
    empty = Completion(prompt_ids=np.zeros(0, np.int32), token_ids=np.zeros(0, np.int32),
                       logprobs=np.zeros(0, np.float32), finish_reason="stop", prompt_index=0, sample_index=0)
    rows, infos = [], []
    for p in range(3):
        rows.append([])
        infos.append([])
        for g in range(G):
            rows[-1] += [_completion_of(a, p * G + g), _completion_of(a, p * G + (g + 1) % G) if g % 2 else empty]
            infos[-1] += [{}, {"agent": {"trained_sequence": 1}} if g % 2 else {}]
    two = pack_rollouts(task, a.problems, rows, T, group_ids=range(3), rows_per_episode=2, row_infos=infos)
    assert two.tokens.shape == (3 * G * 2, T) and two.rewards.shape == (3, G) and two.group_rows == 2 * G
    np.testing.assert_array_equal(two.rewards, a.rewards)  # graded on each episode's first row
    np.testing.assert_array_equal(two.tokens[::2], a.tokens)
    np.testing.assert_array_equal(two.episode_rows, np.arange(3 * G) * 2)
    # Every first row, and the second rows of odd samples (episode b // 2 = p * G + g).
    used = np.asarray([s == 0 or (b // 2) % G % 2 == 1 for b in range(3 * G * 2) for s in [b % 2]])
    np.testing.assert_array_equal(two.used_rows, used)
    assert not two.valid[~used].any() and two.infos[1] == {} and two.infos[3] == {"agent": {"trained_sequence": 1}}
    joined = Rollouts.concat([two.take([2]), two.take([0])])
    np.testing.assert_array_equal(joined.tokens, np.concatenate([two.tokens[4 * G:], two.tokens[:2 * G]]))
    assert joined.rows_per_episode == 2 and joined.infos == two.infos[4 * G:] + two.infos[:2 * G]
    with pytest.raises(ValueError, match="rows per episode"):
        Rollouts.concat([two, a])
    records = trajectory_records(two, np.arange(3 * G * 2, dtype=np.float32))
    assert len(records) == used.sum()
    assert [(r["group_id"], r["sample_index"], r["advantage"]) for r in records] == \
        [(b // 2 // G, b // 2 % G, b) for b in np.flatnonzero(used)]


def _completion_of(ro: Rollouts, b: int) -> Completion:
    n_p, n_g = ro.prompt_lengths[b], ro.completion_lengths[b]
    return Completion(prompt_ids=ro.tokens[b, :n_p], token_ids=ro.tokens[b, n_p:n_p + n_g],
                      logprobs=ro.rollout_logprobs[b, n_p:n_p + n_g], finish_reason=ro.finish_reasons[b],
                      prompt_index=b // G, sample_index=b % G, versions=ro.token_versions[b, n_p:n_p + n_g])
