"""Prompt and observation chunks take the smallest listed token bucket that fits (the loop and demo
tests run with one bucket of each kind, so the choice among several is checked here)."""

import numpy as np
import pytest

from codedance_jax.rollout.buckets import pow2, round_up, token_bucket


def test_token_bucket_is_the_smallest_that_fits_in_any_listed_order():
    rng = np.random.default_rng()
    buckets = sorted({int(x) for x in rng.integers(8, 4096, 5)})
    shuffled = list(rng.permutation(buckets))
    for n in [1, *buckets, *(b + 1 for b in buckets[:-1]), *rng.integers(1, buckets[-1] + 1, 20)]:
        want = min(b for b in buckets if b >= n)
        assert token_bucket(int(n), shuffled, "a prompt") == want
    with pytest.raises(ValueError, match=f"a prompt of {buckets[-1] + 1} tokens exceeds the largest token bucket "
                                         f"{buckets[-1]}"):
        token_bucket(buckets[-1] + 1, shuffled, "a prompt")


def test_pow2_and_round_up():
    rng = np.random.default_rng()
    for n in rng.integers(1, 10_000, 50):
        p = pow2(int(n))
        assert p >= n and p & (p - 1) == 0 and p // 2 < n
        m = int(rng.integers(1, 64))
        r = round_up(int(n), m)
        assert r % m == 0 and n <= r < n + m
    assert pow2(3, minimum=16) == 16
