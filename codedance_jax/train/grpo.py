"""The GRPO update: recompute log-probs of finished trajectories, clipped loss, one optimizer step.

One jitted sharded step per global batch of trajectories. It scans over micro-batches (the
log-prob recompute is the memory peak), passing the step's global sequence/token count as the
loss denominator so micro-batch losses and gradients add up to the full-batch ones, then applies
the optimizer once. State, mesh, shardings and checkpoints are the training core's (`train.state`,
`train.checkpointing`); the batch carries the SFT fields plus

    old_logprobs float32[B, T]  sampling policy's log-probs of targets (0 off the loss mask)
    ref_logprobs float32[B, T]  frozen reference's, only when KL is on
    turn_ids     int32[B, T]    turn of each trained target token, -1 elsewhere
    a_seq        float32[B]     sequence advantages (R_BAT kernel)
    a_turn       float32[B, M]  turn advantages (R_BAT kernel)

all aligned with `targets` (position t predicts token t + 1).

Old log-probs: with `old_from_forward` the step takes the old policy's log-probs from its own
forward (`stop_gradient` of the current log-probs) instead of the batch. The loop makes ONE update
per batch of rollouts, so the parameters of that forward are the old policy's: a separate
recompute (verl's) is the same forward run twice (at Tunix's sizes 10-15% of a whole step; Tunix
skips it the same way when `num_iterations` is 1). The batch's `old_logprobs` are then the
sampler's, and the metric `logprob_mismatch` is their max distance to the recomputed ones over the
trained tokens (the check verl's recompute gives).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from codedance_jax import sharding as shd
from codedance_jax.rl.grpo_loss import GRPOLossConfig, grpo_loss
from codedance_jax.train.sft import split_micro, target_logprobs
from codedance_jax.train.state import ModelDef, TrainState

GRPO_FIELDS = ("old_logprobs", "ref_logprobs", "turn_ids", "a_seq", "a_turn")


def policy_logprobs(params, batch, mdef: ModelDef, *, temperature: float = 1.0, chunk: int = 512, with_entropy=False):
    """Log-probs of `targets` under `params` (log-softmax of logits / temperature, as sampled)."""
    return target_logprobs(mdef, params, batch, temperature=temperature, chunk=chunk, with_entropy=with_entropy)


def global_denom(batch, cfg: GRPOLossConfig):
    mask = (batch["loss_mask"] > 0) & (batch["turn_ids"] >= 0)
    if cfg.aggregation == "token_mean":
        return mask.sum().astype(jnp.float32)
    return (mask.sum(axis=1) > 0).sum().astype(jnp.float32)


def whole_batch_fields(batch: dict, accum_steps: int) -> dict:
    """The batch for `accum_steps` micro-batches: pack_src indexes the whole batch, so micro-batches
    run unpacked; feat_src (images shared across rows) cannot be split, so it is an error."""
    if accum_steps == 1:
        return batch
    if "feat_src" in batch:
        raise ValueError(f"the batch shares images across rows (feat_src) but grad_accum={accum_steps} splits it into "
                         "micro-batches; build it with rl_batch.grpo_batch(share_images=False)")
    return {k: v for k, v in batch.items() if k != "pack_src"}


def grpo_train_step(state: TrainState, batch: dict, rng, *, mdef: ModelDef, tx, schedule, loss_cfg: GRPOLossConfig,
                    accum_steps: int = 1, temperature: float = 1.0, chunk: int = 512, old_from_forward: bool = False):
    del rng
    denom = global_denom(batch, loss_cfg)
    batch = whole_batch_fields(batch, accum_steps)

    def loss_fn(params, mb):
        lp, ent = policy_logprobs(params, mb, mdef, temperature=temperature, chunk=chunk, with_entropy=True)
        old = jax.lax.stop_gradient(lp) if old_from_forward else mb["old_logprobs"]
        loss, m = grpo_loss(lp, old, mb.get("ref_logprobs"), mb["loss_mask"], mb["turn_ids"],
                            mb["a_seq"], mb["a_turn"], loss_cfg, entropy=ent, denom=denom)
        if old_from_forward:  # the recomputed vs the sampler's log-probs, over the trained tokens
            gap = jnp.abs(jax.lax.stop_gradient(lp) - mb["old_logprobs"].astype(jnp.float32))
            m["logprob_mismatch"] = jnp.max(jnp.where(mb["loss_mask"] > 0, gap, 0.0))
        return loss, m

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    zeros = shd.constrain_like_params(jax.tree.map(jnp.zeros_like, state.params))

    def micro(carry, mb):
        g_acc, m_acc = carry
        (_, m), g = grad_fn(state.params, mb)
        g = shd.constrain_like_params(g)  # reduce-scatter to the parameters' layout (FSDP, issue 19)
        w = m["n_tokens"]  # token-weighted averages of the per-token metrics
        m_acc = {k: (jnp.maximum(m_acc[k], m[k]) if k in MAX_METRICS else m_acc[k] + (m[k] * w if k in TOKEN_METRICS else m[k]))
                 for k in m_acc}
        return (jax.tree.map(jnp.add, g_acc, g), m_acc), None

    # Metric names come from one abstract evaluation of the loss.
    names = jax.eval_shape(lambda p, b: loss_fn(p, b)[1], state.params, batch if accum_steps == 1 else
                           jax.tree.map(lambda x: x[0], split_micro(batch, accum_steps)))
    m0 = {k: jnp.zeros((), jnp.float32) for k in names}
    if accum_steps == 1:
        (g, m), _ = micro((zeros, m0), batch)
    else:
        (g, m), _ = jax.lax.scan(micro, (zeros, m0), split_micro(batch, accum_steps))
    n_tok = jnp.maximum(m["n_tokens"], 1.0)
    metrics = {k: (v / n_tok if k in TOKEN_METRICS else v) for k, v in m.items()}
    updates, opt_state = tx.update(g, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics.update(grad_norm=optax.tree.norm(g), lr=schedule(state.step))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


# Per-token means inside the loss: re-weighted by token counts across micro-batches. The others
# (pg_loss, kl_ref, loss: already divided by the global denominator; n_tokens: a count) are sums.
TOKEN_METRICS = ("clip_frac", "ppo_kl", "ratio_mean", "adv_mean", "entropy")
MAX_METRICS = ("logprob_mismatch",)  # maxima over the micro-batches


def make_grpo_step(mdef: ModelDef, tx, schedule, loss_cfg, state_sh, batch_sh, mesh, *, accum_steps=1,
                   temperature=1.0, chunk=512, rules=None, old_from_forward=False, compiler_options=None):
    """jit(grpo_train_step), the state donated; `compiler_options`: XLA options for its compile (see
    `sft.make_train_step`)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    fn = functools.partial(grpo_train_step, mdef=mdef, tx=tx, schedule=schedule, loss_cfg=loss_cfg,
                           accum_steps=accum_steps, temperature=temperature, chunk=chunk,
                           old_from_forward=old_from_forward)
    fn = shd.with_compute_sharding(fn, mesh, rules)  # FSDP at use (issue 19)
    return jax.jit(fn, in_shardings=(state_sh, batch_sh, replicated), out_shardings=(state_sh, replicated), donate_argnums=0,
                   compiler_options=compiler_options)


def make_logprob_fn(mdef: ModelDef, params_sh, batch_sh, mesh, *, temperature=1.0, chunk=512, accum_steps=1,
                    rules=None, compiler_options=None):
    """jit: log-probs of targets under given params (old-policy or reference recompute).

    `accum_steps` > 1 runs the batch in that many micro-batches (`lax.scan`), as the update does:
    a 7B forward over 2,048 rows of 8k tokens at once does not fit any chip.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    fn = functools.partial(policy_logprobs, mdef=mdef, temperature=temperature, chunk=chunk)

    def run(p, b):
        b = whole_batch_fields(b, accum_steps)
        if accum_steps == 1:
            return fn(p, b)
        # The parameters ride the loop as its carry, not as a closure: a model merged in the body from
        # closed-over parameters cannot be remat'ed (nnx.remat raised TraceContextError under the
        # presets' remat="full"; issue 19).
        _, lp = jax.lax.scan(lambda q, mb: (q, fn(q, mb)), p, split_micro(b, accum_steps))  # [n, B/n, T]
        return lp.swapaxes(0, 1).reshape(-1, lp.shape[-1])  # undo the strided split: row order kept

    run = shd.with_compute_sharding(run, mesh, rules)  # FSDP at use (issue 19)
    return jax.jit(run, in_shardings=(params_sh, batch_sh), out_shardings=replicated, compiler_options=compiler_options)
