"""`eval.drift`: KL of a sampling policy to a reference on the policy's own samples (issue 18)."""

import dataclasses

import jax
import numpy as np
from flax import nnx
from rollout_helpers import full_logprobs, random_image

from eval.drift import policy_drift, token_estimates


@dataclasses.dataclass
class Traj:  # the fields of a trajectory record that the drift reads
    tokens: list
    loss_mask: list
    logprobs: list
    images: list


def _trajectories(model, processor, n=6):
    """Prompt (an image and a question) + random 'sampled' tokens, with the model's own log-probs as
    the recorded ones: the drift against the model itself is then 0 only if every offset lines up."""
    rng = np.random.default_rng()
    out = []
    for i in range(n):
        images = [random_image(int(rng.integers(1 << 30)))] if i % 3 else []
        text = ("<|vision_start|><|image_pad|><|vision_end|>" if images else "") + "How many bars?"
        prompt = processor(text=[text], images=images or None)["input_ids"][0].tolist()
        gen = rng.integers(1000, 5000, size=int(rng.integers(3, 12))).tolist()
        out.append(Traj(prompt + gen, [False] * len(prompt) + [True] * len(gen), [], images))
    lps = full_logprobs(model, processor, out, length=max(len(t.tokens) for t in out))
    for t, lp in zip(out, lps, strict=True):
        t.logprobs = np.where(t.loss_mask, lp, 0.0).tolist()
    return out


def _perturbed(model, scale):
    """A copy with noise on every float weight (added in numpy: no compile per leaf)."""
    rng = np.random.default_rng()
    graphdef, state = nnx.split(model)

    def noisy(x):
        a = np.asarray(x)
        return jax.numpy.asarray(a + scale * rng.standard_normal(a.shape).astype(a.dtype)) if a.dtype.kind == "f" else x

    return nnx.merge(graphdef, jax.tree.map(noisy, state))


def test_estimators_average_to_the_exact_kl():
    rng = np.random.default_rng()
    # Half uniform, so every probability is >= 1/12 and q/p <= 7: with a tiny p_i the k3 average is
    # heavy-tailed and missed the tolerance in ~0.4% of draws (simulated).
    p, q = (0.5 * rng.dirichlet(np.ones(6)) + 0.5 / 6 for _ in range(2))
    x = rng.choice(6, size=400_000, p=p)
    k1, k3 = token_estimates(np.log(p[x]), np.log(q[x]))
    exact = float(np.sum(p * np.log(p / q)))
    assert (k3 >= 0).all()
    np.testing.assert_allclose([k1.mean(), k3.mean()], [exact, exact], rtol=0.03, atol=2e-3)


def test_drift_is_zero_against_the_sampling_policy_and_matches_a_full_forward_against_another_one(model, processor):
    trajs = _trajectories(model, processor)
    steps = [i % 2 for i in range(len(trajs))]
    step_of = {id(t): s for t, s in zip(trajs, steps, strict=True)}.__getitem__
    same = policy_drift(trajs, model, processor, step_of=lambda t: step_of(id(t)), batch=4)
    assert [r["step"] for r in same] == [0, 1] and sum(r["trajectories"] for r in same) == len(trajs)
    assert all(r["tokens"] > 0 for r in same)
    for r in same:
        assert abs(r["kl_k1"]) < 1e-5 and 0 <= r["kl_k3"] < 1e-9, r

    other = _perturbed(model, 0.05)
    moved = policy_drift(trajs, other, processor, step_of=lambda t: step_of(id(t)), batch=4)
    ref = full_logprobs(other, processor, trajs, length=max(len(t.tokens) for t in trajs))
    for r in moved:
        ks = [token_estimates(np.asarray(t.logprobs)[m], lp[m])[1]
              for t, lp, s in zip(trajs, ref, steps, strict=True) if s == r["step"]
              for m in [np.asarray(t.loss_mask, bool) & (np.arange(len(t.tokens)) > 0)]]
        k3 = np.concatenate(ks)
        assert r["tokens"] == k3.size
        assert r["kl_k3"] > 1e-4
        np.testing.assert_allclose(r["kl_k3"], k3.mean(), rtol=1e-3)
