"""How far a policy has moved from a reference, measured on the policy's own samples.

Issue 18 asks for proof that GRPO moves the policy at all before comparing rewards. Each saved
GRPO trajectory carries the sampling policy's log-probs of its sampled tokens (`logprobs` where
`loss_mask`), so one forward of the reference (the SFT policy) over the same tokens gives, per
sampled token x ~ pi,

    k1 = log pi(x) - log ref(x)            E[k1] = KL(pi || ref), unbiased, noisy
    k3 = r - 1 - log r,  r = ref(x) / pi(x)  E[k3] = KL(pi || ref), unbiased and >= 0 per token

(Schulman's estimators). Both are averaged over the sampled tokens of each step's trajectories.
The reference's log-probs use the sampling temperature, as the sampler's do.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np


@functools.cache
def _forward():
    from flax import nnx

    from codedance_jax.train.logprobs import output_weight, token_logprobs

    def run(model, ids, positions, mask, vis, targets, temperature):
        h = model.forward(ids, positions, mask, vis, return_hidden=True)
        return token_logprobs(h, output_weight(model), targets, temperature=temperature)

    return nnx.jit(run, static_argnums=6)


def reference_logprobs(model, processor, trajs: Sequence, *, temperature: float = 1.0, pad_to: int = 64,
                       length: int | None = None, rows: int | None = None, vision: dict | None = None) -> list:
    """log ref(token t | tokens < t) for each trajectory (float[T], entry 0 is 0), one forward per call.
    Rows are right-padded to a multiple of `pad_to`, or to `length`; `rows` pads the batch with
    empty rows and `vision` ({num_units, num_windows}) pads the vision plan, so that every call of
    one `policy_drift` has one shape (one compilation)."""
    import jax.numpy as jnp

    n = max(len(t.tokens) for t in trajs)
    length = length or -(-n // pad_to) * pad_to
    ids = np.full((max(rows or 0, len(trajs)), length), processor.pad_id, np.int64)
    mask = np.zeros_like(ids)
    images = []
    for r, t in enumerate(trajs):
        ids[r, : len(t.tokens)] = t.tokens
        mask[r, : len(t.tokens)] = 1
        images.extend(t.images)
    pv, grid = processor.encode_images(images) if images else (None, None)
    p = model.prepare(ids, mask, pv, grid, **(vision or {}))
    targets = jnp.asarray(np.concatenate([ids[:, 1:], ids[:, :1]], axis=1), jnp.int32)
    lp = np.asarray(_forward()(model, p["input_ids"], p["positions"], p["attention_mask"], p["vis"], targets,
                               float(temperature)))
    out = []
    for r, t in enumerate(trajs):
        row = np.zeros(len(t.tokens))
        row[1:] = lp[r, : len(t.tokens) - 1]
        out.append(row)
    return out


def token_estimates(sampled_lp: np.ndarray, ref_lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k1, k3) per sampled token from the policy's and the reference's log-probs of it."""
    log_r = np.asarray(ref_lp, np.float64) - np.asarray(sampled_lp, np.float64)
    return -log_r, np.expm1(log_r) - log_r


def policy_drift(trajs: Iterable, model, processor, *, step_of, temperature: float = 1.0, batch: int = 16) -> list[dict]:
    """Per step (`step_of(traj)`), the mean k1 and k3 over the sampled tokens of its trajectories,
    against the reference `model`: [{step, kl_k1, kl_k3, tokens, trajectories}] in step order."""
    by_step: dict[int, list] = {}
    for t in trajs:
        by_step.setdefault(int(step_of(t)), []).append(t)
    # One shape for every call (rows, tokens, vision plan), so the reference compiles once.
    chunks = [g[i : i + batch] for g in by_step.values() for i in range(0, len(g), batch)]
    shape = {}
    if chunks:
        from codedance_jax.rollout.shapes import grid_needs

        pad = 64
        shape["length"] = -(-max(len(t.tokens) for c in chunks for t in c) // pad) * pad
        shape["rows"] = max(len(c) for c in chunks)
        if all(getattr(t, "image_grid_thw", None) is not None or not t.images for c in chunks for t in c):
            needs = [grid_needs(np.asarray([g for t in c for g in (getattr(t, "image_grid_thw", None) or [])]
                                           ).reshape(-1, 3), model.cfg.vision) for c in chunks]
            shape["vision"] = {"num_units": max(u for u, _ in needs) or 1,
                               "num_windows": max(w for _, w in needs) or 1}
    rows = []
    for step in sorted(by_step):
        group = by_step[step]
        k1s, k3s = [], []
        for i in range(0, len(group), batch):
            chunk = group[i : i + batch]
            refs = reference_logprobs(model, processor, chunk, temperature=temperature, **shape)
            for t, ref in zip(chunk, refs, strict=True):
                m = np.asarray(t.loss_mask, bool)
                m[0] = False  # token 0 has no prefix
                k1, k3 = token_estimates(np.asarray(t.logprobs)[m], ref[m])
                k1s.append(k1)
                k3s.append(k3)
        k1, k3 = np.concatenate(k1s), np.concatenate(k3s)
        rows.append({"step": step, "kl_k1": float(k1.mean()) if k1.size else float("nan"),
                     "kl_k3": float(k3.mean()) if k3.size else float("nan"), "tokens": int(k1.size),
                     "trajectories": len(group)})
    return rows
