"""SFT: cross-entropy on assistant tokens, one jitted sharded step with micro-batch accumulation.

The loss is the token mean over the whole global batch (sum of -log p over `loss_mask`, divided
by the number of loss tokens), so it is the same number whatever the mesh shape or the number of
micro-batches: accumulation sums token losses and token counts and divides once.

`norm_tokens` > 0 divides the gradient by that constant instead (the reported loss stays the token
mean): every loss token of the data then weighs the same, whatever batch it lands in. With the
token mean, a batch of short examples gives each of its tokens more weight than a batch of long
ones, and length-grouped batches (`data.group_window`) make that systematic: the toy world's SFT
policy took the short (direct) choice 3-9 times more often than its data did (issue 47).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from codedance_jax import sharding as shd
from codedance_jax.model.qwen25vl import VisionInputs
from codedance_jax.train import packing
from codedance_jax.train.batching import VISION_KEYS
from codedance_jax.train.logprobs import output_weight, token_logprobs
from codedance_jax.train.state import ModelDef, TrainState

# pack_src (optional): the packed layout of `train.packing` (GRPO batches); segment_ids (optional):
# rows holding several examples (`batching.collate_packed`, SFT batches).
# feat_src (optional): images shared across rows (`packing.share_images`, GRPO batches).
BATCH_FIELDS = ("input_ids", "attention_mask", "targets", "loss_mask", "positions", *VISION_KEYS, "feat_src",
                "pack_src", "segment_ids")
# Logical axes of each batch field; `positions` carries the batch on its second axis.
BATCH_AXES = {"positions": (None, "batch", None)}


def batch_axes(key: str, ndim: int):
    return BATCH_AXES.get(key, ("batch",) + (None,) * (ndim - 1))


def batch_shardings(batch_shapes: dict, mesh, rules=None) -> dict:
    return {k: NamedSharding(mesh, shd.logical_to_spec(batch_axes(k, len(v.shape)), rules, mesh)) for k, v in batch_shapes.items()}


def vision_inputs(batch) -> VisionInputs | None:
    if "pixel_values" not in batch:
        return None
    return VisionInputs(*(batch[k] for k in VISION_KEYS), feat_src=batch.get("feat_src"))


def hidden_states(mdef: ModelDef, params, batch):
    model = mdef.model(params)
    h = model.forward(batch["input_ids"], batch["positions"], batch["attention_mask"], vision_inputs(batch), return_hidden=True,
                      segment_ids=batch.get("segment_ids"))
    return model, h


def target_logprobs(mdef: ModelDef, params, batch, *, temperature: float = 1.0, chunk: int = 512,
                    with_entropy: bool = False):
    """Log-probs of `targets` [B, T] (and entropies); with `pack_src` in the batch the decoder and
    the output layer run over the packed rows only (`train.packing`), the result is unpacked."""
    if "pack_src" not in batch:
        model, h = hidden_states(mdef, params, batch)
        return token_logprobs(h, output_weight(model), batch["targets"], temperature=temperature, chunk=chunk,
                              with_entropy=with_entropy)
    model = mdef.model(params)
    h, src = model.forward_packed(batch["input_ids"], batch["positions"], batch["pack_src"], vision_inputs(batch))
    out = token_logprobs(h, output_weight(model), packing.gather_packed(batch["targets"], src),
                         temperature=temperature, chunk=chunk, with_entropy=with_entropy)
    shape = batch["targets"].shape
    return tuple(packing.unpack(x, src, shape) for x in out) if with_entropy else packing.unpack(out, src, shape)


def sft_loss_sums(params, batch, mdef: ModelDef, chunk: int = 512):
    """(sum of token NLL over loss_mask, number of loss tokens)."""
    lp = target_logprobs(mdef, params, batch, chunk=chunk)
    mask = batch["loss_mask"].astype(jnp.float32)
    return -(lp * mask).sum(), mask.sum()


def split_micro(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...] for every field (positions: [3, B, T] -> [n, 3, B/n, T]).

    Micro-batch j takes rows j, j + n, j + 2n, ...: the batch is sharded in contiguous blocks over
    the chips, so a strided split leaves every micro-batch spread over all of them (a contiguous
    split put each micro-batch on 1/n of the chips, and XLA resharded or computed it there; issue 19).
    Losses and gradients are sums over all micro-batches, so the order does not change them.
    """
    out = {}
    for k, v in batch.items():
        if k == "positions":
            out[k] = v.reshape(v.shape[0], -1, n, *v.shape[2:]).transpose(2, 0, 1, *range(3, v.ndim + 1))
        else:
            out[k] = v.reshape(-1, n, *v.shape[1:]).swapaxes(0, 1)
    return out


def train_step(state: TrainState, batch: dict, rng, *, mdef: ModelDef, tx, schedule, accum_steps: int = 1, chunk: int = 512,
               norm_tokens: int = 0):
    """One optimizer update on a global batch. Pure; jit with `make_train_step`. `norm_tokens`: the
    gradient's constant divisor (0: the batch's loss-token count)."""
    del rng  # SFT has no stochastic layers; the signature is shared with GRPO
    grad_fn = jax.value_and_grad(sft_loss_sums, has_aux=True)

    def micro(carry, mb):
        g_acc, l_acc, n_acc = carry
        (loss_sum, n), g = grad_fn(state.params, mb, mdef, chunk)
        g = shd.constrain_like_params(g)  # reduce-scatter to the parameters' layout (FSDP, issue 19)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss_sum, n_acc + n), None

    zeros = shd.constrain_like_params(jax.tree.map(jnp.zeros_like, state.params))
    if accum_steps == 1:
        (g, loss_sum, n), _ = micro((zeros, 0.0, 0.0), batch)
    else:
        (g, loss_sum, n), _ = jax.lax.scan(micro, (zeros, 0.0, 0.0), split_micro(batch, accum_steps))
    denom = jnp.maximum(n, 1.0)
    grad_denom = denom if norm_tokens <= 0 else jnp.float32(norm_tokens)
    grads = jax.tree.map(lambda x: x / grad_denom, g)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss_sum / denom,
        "loss_tokens": n,
        "tokens": batch["attention_mask"].sum().astype(jnp.float32),
        "grad_norm": optax.tree.norm(grads),
        "lr": schedule(state.step),
    }
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              rng=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]))
    return new_state, metrics


def make_train_step(mdef: ModelDef, tx, schedule, state_sh, batch_sh, mesh, *, accum_steps: int = 1, chunk: int = 512,
                    rules=None, compiler_options=None, norm_tokens: int = 0):
    """jit(train_step) with explicit in/out shardings and the state donated (`rules`: the state's logical rules).

    `compiler_options`: XLA options for this step's compiles only (None: XLA's defaults), e.g.
    `{"xla_backend_optimization_level": 0}` where compiling costs more than running, as in a few
    steps of a tiny model: on XLA CPU it halved a tiny SFT step's compile (11.7 -> 6.6 s).
    """
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    fn = functools.partial(train_step, mdef=mdef, tx=tx, schedule=schedule, accum_steps=accum_steps, chunk=chunk,
                           norm_tokens=int(norm_tokens))
    # FSDP at use: weights gathered per layer, activations and gradients kept sharded (issue 19).
    fn = shd.with_compute_sharding(fn, mesh, rules)
    return jax.jit(fn, in_shardings=(state_sh, batch_sh, replicated), out_shardings=(state_sh, replicated), donate_argnums=0,
                   compiler_options=compiler_options)
