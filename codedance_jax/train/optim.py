"""Optimizer: AdamW with linear warmup + cosine decay, global-norm clipping, decay mask.

Weight decay skips 1-D parameters (RMSNorm scales, biases), the usual choice for transformers
(and what HF Trainer, used by the authors' SFT, does). Gradient accumulation is not done here:
the train step scans over micro-batches and applies one update (see `train.sft`).

`optim.freeze` (optional) names top-level parameter groups of the model (`visual`, `embed`,
`layers`, `norm`, `lm_head`) that get no update (their Adam moments stay zero); the gradient-norm
clip sees only the trained ones. Why it exists: on the toy world GRPO degraded the SFT policy's
reading of cropped observation images, and a frozen vision tower kept it (WORKSPACE.md, "Why
GRPO lost accuracy").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def schedule(lr: float, total_steps: int, warmup_ratio: float = 0.05, min_lr_ratio: float = 0.0, kind: str = "cosine"):
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0
    if kind == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]) if warmup else optax.constant_schedule(lr)
    if kind != "cosine":
        raise ValueError(f"config.optim.schedule={kind!r}: choose 'cosine' or 'constant'.")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1),
        end_value=lr * min_lr_ratio,
    )


def _group(path) -> str:
    return str(getattr(path[0], "key", path[0]))  # parameter trees (nnx.State, pure dicts) have DictKey paths


def zero_groups(freeze) -> optax.GradientTransformation:
    """Stateless: the updates of the top-level parameter groups named in `freeze` become 0 (traced
    once per jitted step; an unknown group name is an error naming the model's groups)."""
    names = set(freeze)

    def update(updates, state, params=None):
        del params
        groups = {_group(path) for path, _ in jax.tree_util.tree_leaves_with_path(updates)}
        unknown = sorted(names - groups)
        if unknown:
            raise ValueError(f"config.optim.freeze={tuple(freeze)}: no parameter group {unknown}; the model's groups "
                             f"are {sorted(groups)}")
        zero = lambda path, u: jnp.zeros_like(u) if _group(path) in names else u  # noqa: E731
        return jax.tree_util.tree_map_with_path(zero, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(optim, total_steps: int):
    """optim: a ConfigDict/dict with lr, warmup_ratio, weight_decay, b1, b2, eps, clip_norm, schedule
    and optionally freeze (parameter groups without updates)."""
    sched = schedule(optim.lr, total_steps, optim.warmup_ratio, optim.get("min_lr_ratio", 0.0), optim.get("schedule", "cosine"))
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(optim.clip_norm) if optim.clip_norm else optax.identity(),
        optax.adamw(sched, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay, mask=decay_mask),
    )
    freeze = tuple(optim.get("freeze", ()) or ())
    if freeze:  # zeroed before the clip (its norm sees the trained groups only) and after AdamW (no decay)
        tx = optax.chain(zero_groups(freeze), tx, zero_groups(freeze))
    return tx, sched
