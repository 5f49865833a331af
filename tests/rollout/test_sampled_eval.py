"""`eval.rollouts.evaluate` with k samples per item: scored against the right item, reproducible for
a fixed seed whatever the batch size, different from greedy decoding, with intervals clustered by item."""

import dataclasses

import numpy as np
import pytest
from rollout_helpers import random_image, small_config

from codedance_jax.rollout import RolloutEngine, SamplingConfig
from eval.intervals import clustered_wilson, wilson
from eval.rollouts import evaluate


@dataclasses.dataclass
class Item:
    id: str
    question: str
    images: list
    answer: str
    meta: dict


def _items(seed):
    rng = np.random.default_rng(seed)
    return [Item(f"q{i}", "How many?", [random_image(int(rng.integers(1 << 30)))], str(i),
                 {"difficulty": "easy" if i % 2 else "hard"}) for i in range(3)]


def test_scripted_samples_are_scored_per_item(model, processor):
    items = _items(0)
    k = 3
    engine = RolloutEngine(model, processor, small_config(max_turns=1), SamplingConfig(temperature=1.0, seed=0))
    rng = np.random.default_rng()
    right = rng.random(len(items) * k) < 0.5  # row r = item r // k, sample r % k

    def script(row, turn):  # one batch, so `row` (the engine's row) is the global row
        return f"<answer>{row // k if right[row] else 9}</answer>"

    res = evaluate(engine, items, None, keys=("difficulty",), samples=k, intervals=True, script=script)
    assert [t.prompt_id for t in res.trajectories] == [it.id for it in items for _ in range(k)]
    assert [t.correct for t in res.trajectories] == right.tolist()
    s = res.summary
    assert s["n"] == 9 and s["n_items"] == 3 and s["samples_per_item"] == k
    assert s["accuracy"] == pytest.approx(right.mean())
    y = right.reshape(len(items), k).sum(1)
    assert s["accuracy_ci95"] == pytest.approx(list(clustered_wilson(y, np.full(len(items), k))[:2]))
    assert s["difficulty=easy/n_items"] == 1 and s["difficulty=hard/n"] == 6
    assert s["tool_rate"] == 0 and s["tool_rate_ci95"] == pytest.approx(list(wilson(0, 3)))  # 0 of k on each item: 0/3


def test_sampled_eval_reproducible_and_not_greedy(model, processor):
    items = _items(1)
    cfg = small_config(max_turns=1, max_turn_tokens=12, max_new_tokens=12)

    def run(batch, greedy=False, seed=5, samples=2):
        sampling = SamplingConfig(greedy=True) if greedy else SamplingConfig(temperature=1.0, seed=seed)
        res = evaluate(RolloutEngine(model, processor, cfg, sampling), items, None, batch=batch, samples=samples,
                       intervals=True)
        return [tuple(t.tokens) for t in res.trajectories]

    a = run(batch=2)
    assert run(batch=3) == a  # the same draws whatever the batching: keys follow the row
    assert a[0] != a[1]  # an item's samples differ
    assert run(batch=3, seed=6) != a
    greedy = run(batch=3, greedy=True, samples=1)
    assert greedy != a[::2] and greedy != a[1::2]
