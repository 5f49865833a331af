"""The GRPO policy loss (paper eq. 3) as a pure function of arrays, and the log-prob helper.

`grpo_loss` is the PPO clipped-ratio objective on per-token advantages
`a_tok[b, t] = a_seq[b] + a_turn[b, turn_ids[b, t]]`, aggregated per sequence then over sequences
(eq. 3: 1/G Σ_i 1/|τ_i| Σ_t), or per token (DAPO-style token mean) as an option.

Departures from textbook GRPO, all config switches (the defaults are the paper's eq. 3):
- no KL term by default (the paper omits it); `kl_coef > 0` adds the k3 estimator to a frozen
  reference, `exp(ref − lp) − (ref − lp) − 1`, clamped as verl's `low_var_kl` does;
- asymmetric "clip-higher" (DAPO, Yu et al. 2025): `clip_eps_low` / `clip_eps_high` override ε on
  either side;
- the normaliser (`aggregation`): per sequence length (eq. 3), one token mean over the batch (DAPO),
  or a constant L for every sequence (`seq_sum_norm`, Dr. GRPO, Liu et al. 2025: 1/G Σ_i 1/L Σ_t);
- the importance ratio (`ratio`): per token (eq. 3), or GSPO's (Zheng et al. 2025) sequence ratio
  s_i = exp(1/|y_i| Σ_t log π/π_old) in its token form s_{i,t} = sg[s_i]·π(y_t)/sg[π(y_t)], so each
  token keeps its own advantage (R_BAT's A_seq + A_turn of its turn) and the clip is on s_i;
- the loss is a *minimization* target: loss = −J.

Micro-batching: the aggregation divides by the number of sequences (or tokens) in the arrays it is
given. When a step accumulates gradients over micro-batches, pass `denom` = that count over the
whole step, so the sum of micro-batch losses equals the loss of the full batch.

`token_logprobs` turns logits into per-token log-probs the way the sampler records them (SPEC §2:
log-softmax of logits / temperature, before top-p/top-k, as verl does) plus the entropy, in chunks
over T so the float32 [B, T, V] softmax is never materialized whole.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from codedance_jax.rl.registry import register_loss

AGGREGATIONS = ("seq_mean", "token_mean", "seq_sum_norm")


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Hyper-parameters of the clipped policy objective (paper eq. 3)."""

    clip_eps: float = 0.2
    """ε: the ratio r_{i,t} is clipped to [1 − ε, 1 + ε]."""
    clip_eps_low: float | None = None
    """ε_low of asymmetric clipping (DAPO clip-higher); None = ε."""
    clip_eps_high: float | None = None
    """ε_high of asymmetric clipping (DAPO uses 0.28); None = ε."""
    aggregation: Literal["seq_mean", "token_mean", "seq_sum_norm"] = "seq_mean"
    """"seq_mean": mean over each sequence's trained tokens, then over sequences (eq. 3; with G
    sequences per prompt this is the group mean of eq. 3 averaged over prompts). "token_mean": one
    mean over all trained tokens of the batch (DAPO). "seq_sum_norm": each sequence's token sum
    divided by the constant L = `norm_length`, then the mean over sequences (Dr. GRPO: no 1/|o_i|)."""
    norm_length: int = 0
    """L of "seq_sum_norm": the constant normaliser (Dr. GRPO uses the generation budget; the run
    config's default is `rollout.max_new_tokens`). Unused by the other aggregations."""
    ratio: Literal["token", "sequence"] = "token"
    """Importance ratio: "token" r_{i,t} = π(y_t)/π_old(y_t) (eq. 3); "sequence" GSPO's
    s_i = (π(y_i)/π_old(y_i))^(1/|y_i|) over the sequence's trained tokens, token form (see the module
    docstring). GSPO clips far tighter than PPO (ε_low = 3e-4, ε_high = 4e-4 in its paper)."""
    kl_coef: float = 0.0
    """β_KL: weight of the k3 KL to the reference policy (0 = off, the paper's setting)."""

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"GRPOLossConfig.aggregation={self.aggregation!r}: expected one of {AGGREGATIONS}")
        if self.aggregation == "seq_sum_norm" and self.norm_length <= 0:
            raise ValueError(f"GRPOLossConfig.norm_length={self.norm_length}: aggregation 'seq_sum_norm' needs the "
                             "constant L > 0 (e.g. the rollout's max_new_tokens)")
        if self.ratio not in ("token", "sequence"):
            raise ValueError(f"GRPOLossConfig.ratio={self.ratio!r}: expected 'token' or 'sequence'")
        if self.clip_eps <= 0:
            raise ValueError(f"GRPOLossConfig.clip_eps={self.clip_eps}: must be > 0")

    @property
    def eps_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def token_advantages(a_seq: jax.Array, a_turn: jax.Array, turn_ids: jax.Array) -> jax.Array:
    """a_tok[b, t] = a_seq[b] + a_turn[b, turn_ids[b, t]]; 0 where turn_ids < 0 (not trained).

    a_seq: [B]; a_turn: [B, M]; turn_ids: int[B, T]. A turn id ≥ M is clamped to M − 1 (jit cannot
    raise on values); callers size M to the turn budget.
    """
    m = a_turn.shape[1]
    idx = jnp.clip(turn_ids, 0, m - 1)  # [B, T]
    per_turn = jnp.take_along_axis(a_turn.astype(jnp.float32), idx, axis=1)  # [B, T]
    a_tok = a_seq.astype(jnp.float32)[:, None] + per_turn  # [B, T]
    return jnp.where(turn_ids >= 0, a_tok, 0.0)


def _aggregate(x_bt: jax.Array, mask_bt: jax.Array, cfg: GRPOLossConfig, denom) -> jax.Array:
    """Masked mean of per-token values by cfg.aggregation (see the module docstring for denom)."""
    if cfg.aggregation == "token_mean":
        n = mask_bt.sum() if denom is None else denom
        return (x_bt * mask_bt).sum() / jnp.maximum(n, 1.0)
    n_tok = mask_bt.sum(axis=1)  # [B]
    per_seq_norm = float(cfg.norm_length) if cfg.aggregation == "seq_sum_norm" else jnp.maximum(n_tok, 1.0)
    seq_mean = (x_bt * mask_bt).sum(axis=1) / per_seq_norm  # [B]
    # A sequence with no trained token (e.g. padding rows) does not count as a sequence.
    n_seq = (n_tok > 0).sum() if denom is None else denom
    return seq_mean.sum() / jnp.maximum(n_seq, 1.0)


@register_loss("grpo")
def grpo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    ref_logprobs: jax.Array | None,
    loss_mask: jax.Array,
    turn_ids: jax.Array,
    a_seq: jax.Array,
    a_turn: jax.Array,
    cfg: GRPOLossConfig,
    *,
    entropy: jax.Array | None = None,
    denom: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped-ratio GRPO loss (to minimize) and metrics.

    logprobs, old_logprobs, ref_logprobs: float[B, T] log-probs of the sampled tokens under the
    current, sampling and reference policies (ref may be None when kl_coef = 0); loss_mask: [B, T]
    1 on sampled tokens; turn_ids: int[B, T], −1 on tokens not trained; a_seq: [B]; a_turn: [B, M].
    entropy: optional [B, T] per-token entropy, reported as a metric only. denom: the global count
    of sequences (seq_mean, seq_sum_norm) or tokens (token_mean) when accumulating over micro-batches.
    """
    lp = logprobs.astype(jnp.float32)  # [B, T]
    mask = (loss_mask.astype(bool) & (turn_ids >= 0)).astype(jnp.float32)  # [B, T]
    a_tok = token_advantages(a_seq, a_turn, turn_ids)  # [B, T]

    log_ratio = lp - old_logprobs.astype(jnp.float32)  # [B, T]
    # Masked positions may hold garbage log-probs; keep exp() finite there so 0·inf never appears.
    log_ratio = jnp.where(mask > 0, log_ratio, 0.0)
    if cfg.ratio == "sequence":
        # GSPO-token: value s_i = exp(mean_t log ratio) on every token of sequence i; the gradient
        # reaches token t only through its own log-prob, weighted by s_i.
        seq_log_ratio = log_ratio.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)  # [B]
        lp_m = jnp.where(mask > 0, lp, 0.0)  # [B, T]: no garbage (inf − inf) on masked positions
        ratio = jnp.exp(jax.lax.stop_gradient(seq_log_ratio)[:, None] + lp_m - jax.lax.stop_gradient(lp_m))  # [B, T]
    else:
        ratio = jnp.exp(log_ratio)  # [B, T]
    unclipped = -a_tok * ratio
    clipped = -a_tok * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg_tok = jnp.maximum(unclipped, clipped)  # [B, T]: −min(r·A, clip(r)·A)
    pg_loss = _aggregate(pg_tok, mask, cfg, denom)

    n_tok = jnp.maximum(mask.sum(), 1.0)
    tok_mean = lambda x: (x * mask).sum() / n_tok
    metrics = {
        "pg_loss": pg_loss,
        "clip_frac": tok_mean((clipped > unclipped).astype(jnp.float32)),
        "ppo_kl": tok_mean(-log_ratio),  # k1 estimate of KL(old ‖ current), verl's `ppo_kl`
        "ratio_mean": tok_mean(ratio),
        "adv_mean": tok_mean(a_tok),
        "n_tokens": mask.sum(),
    }
    loss = pg_loss
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("GRPOLossConfig.kl_coef > 0 needs ref_logprobs (the frozen reference's log-probs)")
        # k3 estimator, clamped as verl's `low_var_kl`: its exp() explodes on rare tokens.
        d = jnp.clip(ref_logprobs.astype(jnp.float32) - lp, -20.0, 20.0)
        kl_tok = jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)  # [B, T]
        kl = _aggregate(kl_tok, mask, cfg, denom)
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = kl
    if entropy is not None:
        metrics["entropy"] = tok_mean(jax.lax.stop_gradient(entropy.astype(jnp.float32)))
    metrics["loss"] = loss
    return loss, metrics


def token_logprobs(
    logits_btv: jax.Array, targets_bt: jax.Array, *, temperature: float = 1.0, chunk_size: int = 256
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs of `targets` and entropies under softmax(logits / temperature).

    logits_btv: [B, T, V] where logits[:, t] predicts targets[:, t] (shift before calling);
    targets_bt: int[B, T]. Returns (logprobs, entropy), float32[B, T]. The float32 work runs over
    chunks of `chunk_size` positions under `jax.checkpoint`, so forward and backward hold one chunk's
    [B, chunk, V] float32 softmax at a time, not the whole [B, T, V].
    """
    b, t, v = logits_btv.shape
    chunk = max(1, min(chunk_size, t))
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    logits = jnp.pad(logits_btv, ((0, 0), (0, pad), (0, 0)))  # [B, C·chunk, V]
    targets = jnp.pad(targets_bt, ((0, 0), (0, pad)))  # [B, C·chunk]
    logits = logits.reshape(b, n_chunks, chunk, v).swapaxes(0, 1)  # [C, B, chunk, V]
    targets = targets.reshape(b, n_chunks, chunk).swapaxes(0, 1)  # [C, B, chunk]

    @jax.checkpoint
    def one_chunk(args):
        z, y = args
        z = z.astype(jnp.float32) / temperature  # [B, chunk, V]
        lse = jax.nn.logsumexp(z, axis=-1)  # [B, chunk]
        z_y = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]  # [B, chunk]
        p = jax.nn.softmax(z, axis=-1)
        ent = lse - (p * z).sum(axis=-1)  # H = logΣe^z − Σ p z
        return z_y - lse, ent

    lp, ent = jax.lax.map(one_chunk, (logits, targets))  # [C, B, chunk] each
    lp = lp.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]
    return lp, ent
