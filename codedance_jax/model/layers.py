"""Small NNX building blocks shared by both towers: parameters with logical axes, RMSNorm, SwiGLU.

Every parameter carries logical axis names (`out_sharding` metadata); `codedance_jax.sharding`
maps them to mesh axes with one rules table. Mesh axis names never appear in model code.
Parameters are created with eager sharding off so that the same module builds on one CPU, under
`nnx.eval_shape`, or inside a sharded `jit` initialiser.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from codedance_jax import sharding as shd


def param(rngs: nnx.Rngs | None, shape, axes: tuple[str | None, ...], dtype, init: str = "normal") -> nnx.Param:
    """A parameter of `shape` with logical `axes`; random init uses N(0, 0.02) like the reference."""
    assert len(axes) == len(shape), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * _standard_normal(rngs.params(), tuple(shape))).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


# XLA's CPU compiler builds the kernels of a threefry draw (its loop, the normal's inverse-erf)
# once per distinct output shape, ~0.8 s each: the tiny model's small random parameters cost
# ~10 s of its jitted init's compile. A parameter up to this many elements is drawn as a flat
# vector and reshaped, so shapes of equal size share one kernel and 1-D ones are cheaper to
# build: `create_train_state` of the tiny model went from 12.4-13.0 s to 8.7-9.4 s. On one device
# the numbers are the same bit for bit (threefry's counters are the row-major element index); on
# a sharded mesh some differ from the one-device init by ~1 ulp (elementwise float code compiled
# for another layout rounds differently). Larger parameters keep their shape, so that a sharded
# initialiser draws each shard where it lives instead of a whole flat vector first.
FLAT_DRAW_MAX_ELEMENTS = 1 << 20


def _standard_normal(key, shape: tuple[int, ...]):
    n = math.prod(shape)
    if n > FLAT_DRAW_MAX_ELEMENTS:
        return jax.random.normal(key, shape, jnp.float32)
    return jax.random.normal(key, (n,), jnp.float32).reshape(shape)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32; the scale multiplies after casting back, as the reference does."""

    def __init__(self, dim: int, eps: float, axis_name: str, *, dtype, rngs: nnx.Rngs | None = None):
        self.scale = param(rngs, (dim,), (axis_name,), dtype, init="ones")
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        y = (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return shd.gather_param(self.scale, x.dtype) * y


def matmul(x, w, n_in: int = 1):
    """Contract the last `n_in` dims of x with the first `n_in` of w, as ONE 2-D product.

    x[..., *in] @ w[*in, *out] -> [..., *out]. The leading (batch, time) dims and the weight's
    in/out dims are flattened first because XLA CPU runs the weight gradient of an einsum over
    several batch dims (contracting B and T at once) as materialized transposes plus a generic
    dot instead of its fast matmul kernel: at [16, 96, 128] x 512 a SwiGLU's forward+backward was
    2-2.5x slower written as einsums (issue 14). The flattening keeps the dims' order, so the
    batch sharding of x and a sharded head or MLP dim of w carry over to the 2-D operands.
    """
    lead, ins, outs = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in :], w.shape[n_in:]
    assert w.shape[:n_in] == ins, (x.shape, w.shape, n_in)
    k = math.prod(ins)
    y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1))
    return y.reshape(*lead, *outs)


NEG_INF = -1e30  # large finite: a fully masked row gives a uniform (finite) row instead of NaN


@jax.custom_vjp
def masked_softmax(logits, mask):
    """softmax(where(mask, logits, NEG_INF)) over the last axis, float32 logits, bool mask.

    Its own backward, dx = y * g - y * sum(y * g): `jax.nn.softmax` (with `jax_softmax_custom_jvp`
    off, the default in jax 0.10) differentiates its division, so XLA materializes the broadcast
    reciprocal of the row sums and runs more passes over the [.., T, S] probabilities. That
    elementwise work, not the small-head matmuls, was most of the attention's time in a training
    step (issue 14: -10-20% attention fwd+bwd at 16 x 256). Masked entries get a zero gradient,
    as through the `where`, also in a row that sees nothing (uniform y)."""
    x = jnp.where(mask, logits, NEG_INF)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _masked_softmax_fwd(logits, mask):
    y = masked_softmax(logits, mask)
    return y, (y, mask)


def _masked_softmax_bwd(res, g):
    y, mask = res
    gy = g * y
    return jnp.where(mask, gy - y * jnp.sum(gy, axis=-1, keepdims=True), 0.0), None


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


class Dense(nnx.Module):
    """y = x @ W (+ b) with W stored as [in, out] (the transpose of torch's Linear)."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = param(rngs, (d_in, d_out), axes, dtype)
        self.bias = param(rngs, (d_out,), (axes[1],), dtype, init="zeros") if bias else None

    def __call__(self, x):
        y = matmul(x, shd.gather_param(self.kernel, x.dtype))
        if self.bias is not None:
            y = y + shd.gather_param(self.bias, x.dtype)
        return y


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)); the vision tower's variant has biases."""

    def __init__(self, d: int, f: int, axes: tuple[str, str], *, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate = Dense(d, f, axes, bias=bias, dtype=dtype, rngs=rngs)
        self.up = Dense(d, f, axes, bias=bias, dtype=dtype, rngs=rngs)
        self.down = Dense(f, d, (axes[1], axes[0]), bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def remat_policy(name: str):
    """Rematerialization policies selectable from the config."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"model.remat={name!r}: choose one of 'none', 'full', 'dots'.")
