"""Rollouts -> scores -> the GRPO batch: recomputing log-probs from the batch reproduces the sampler's."""

import jax
import numpy as np
from fakes import FakePool
from flax import nnx
from rollout_helpers import random_image, small_config

from codedance_jax import sharding as shd
from codedance_jax.rl import RBATConfig, rbat_advantages, scoring
from codedance_jax.rollout import RolloutEngine, SamplingConfig, rl_prompt
from codedance_jax.train import grpo, rl_batch, sft
from codedance_jax.train import state as st
from codedance_jax.train.batching import check_buckets

SHOW = '<think>look</think><code>\n```python\nshow(28, 56)\nprint("ok")\n```\n</code>'
RAISE = '<think>try</think><code>\n```python\nraise ValueError\n```\n</code>'


def test_grpo_batch_from_trajectories(model, processor):
    engine = RolloutEngine(model, processor, small_config(max_turn_tokens=48), SamplingConfig(temperature=1.0, seed=3))
    prompts = [rl_prompt(processor, f"p{i}", "How many?", [random_image(70 + i)]) for i in range(2)]
    scripts = {(0, 0): SHOW, (0, 1): "<think>seen</think><answer>7</answer>", (1, 0): RAISE,
               (2, 0): "<think>no</think><answer>3</answer>"}
    pool = FakePool()
    try:
        trajs, _ = engine.rollout(prompts, 2, pool, script=lambda r, m: scripts.get((r, m)))
    finally:
        pool.close()
    golds = ["7", "7", "4", "4"]
    sc = scoring.score(trajs, golds, processor, max_turns=engine.cfg.max_turns)
    assert sc.acc[0] == 1.0 and sc.acc[2] == 0.0 and trajs[0].correct and trajs[0].answer == "7"
    assert sc.turn_is_tool[0, 0] and not sc.turn_failed[0, 0] and sc.turn_is_tool[1, 0] and sc.turn_failed[1, 0]
    assert sc.fmt_ok[0] and sc.fmt_ok[2]
    a_seq, a_turn = (np.asarray(x) for x in rbat_advantages(sc.acc, sc.fmt_ok, sc.turn_is_tool, sc.turn_failed,
                                                             group_size=2, cfg=RBATConfig.paper()))
    buckets = check_buckets([(256, 64, 16), (512, 128, 32)])
    batch = rl_batch.grpo_batch(trajs, processor, model.cfg, buckets, a_seq, a_turn)
    assert batch["input_ids"].shape[1] in (256, 512) and batch["a_turn"].shape == (4, engine.cfg.max_turns)
    for b, t in enumerate(trajs):  # targets/old log-probs/turn ids are the record shifted by one
        n = len(t.tokens)
        np.testing.assert_array_equal(batch["targets"][b, : n - 1], t.tokens[1:])
        np.testing.assert_array_equal(batch["loss_mask"][b, : n - 1], t.loss_mask[1:])
        np.testing.assert_array_equal(batch["turn_ids"][b, : n - 1] >= 0, np.asarray(t.loss_mask[1:]) > 0)
        assert batch["loss_mask"][b, n - 1 :].sum() == 0
    # One full forward over the batch (what the GRPO step recomputes) gives the sampler's log-probs.
    mesh = shd.make_mesh(-1, 1, 1)  # all (8 CPU) devices on the batch axis
    mdef, _ = st.abstract_params(model.cfg)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    fields = {k: v for k, v in rl_batch.pad_rows(batch, 8).items() if k in sft.BATCH_FIELDS}
    bsh = sft.batch_shardings(fields, mesh)
    psh = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params)
    lp = np.asarray(grpo.make_logprob_fn(mdef, psh, bsh, mesh, chunk=64)(params, fields))[:4]
    m = batch["loss_mask"] > 0
    assert m.sum() > 20
    np.testing.assert_allclose(lp[m], batch["old_logprobs"][m], atol=2e-4)
    padded = rl_batch.pad_rows(batch, 8)
    assert padded["input_ids"].shape[0] == 8 and padded["loss_mask"][4:].sum() == 0
    assert (padded["turn_ids"][4:] == -1).all() and padded["positions"].shape[1] == 8


def test_text_only_batch_skips_the_vision_tower_and_keeps_logprobs(model, processor):
    engine = RolloutEngine(model, processor, small_config(max_turn_tokens=24), SamplingConfig(temperature=1.0, seed=5))
    prompts = [rl_prompt(processor, f"t{i}", f"Say a number ({i})", []) for i in range(2)]
    trajs, _ = engine.rollout(prompts, 2, None)
    z = np.zeros(4, np.float32)
    batch = rl_batch.grpo_batch(trajs, processor, model.cfg, check_buckets([(256, 64, 16)]), z,
                                np.zeros((4, engine.cfg.max_turns), np.float32))
    assert "pixel_values" not in batch and "unit_src" in batch
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    mdef, _ = st.abstract_params(model.cfg)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    fields = {k: v for k, v in batch.items() if k in sft.BATCH_FIELDS}
    psh = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params)
    lp = np.asarray(grpo.make_logprob_fn(mdef, psh, sft.batch_shardings(fields, mesh), mesh, chunk=64)(params, fields))
    m = batch["loss_mask"] > 0
    assert m.sum() > 10
    np.testing.assert_allclose(lp[m], batch["old_logprobs"][m], atol=2e-4)


def test_batch_stage_trains_only_the_kept_rows(model, processor):
    """`runs.grpo_stages.batch` applies the filter's `Scores.keep` (dynamic sampling, Mini-o3 masking):
    a left-out trajectory keeps its row but trains no token; the kept rows are the plain batch's."""
    import types

    from runs import grpo_stages as stages

    engine = RolloutEngine(model, processor, small_config(max_turn_tokens=24), SamplingConfig(temperature=1.0, seed=7))
    prompts = [rl_prompt(processor, f"k{i}", f"Say a number ({i})", []) for i in range(2)]
    trajs, _ = engine.rollout(prompts, 2, None)
    b, m = len(trajs), engine.cfg.max_turns
    a_seq, a_turn = np.linspace(-1, 1, b).astype(np.float32), np.ones((b, m), np.float32)
    buckets = check_buckets([(256, 64, 16)])
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    ctx = types.SimpleNamespace(processor=processor, cfg=model.cfg, buckets=buckets, mesh=mesh, rules=None, rows=b, layout=None,
                                hosts=1, config=types.SimpleNamespace(grad_accum=1, buckets=((256, 64, 16),)))
    ro = types.SimpleNamespace(trajectories=trajs)
    keep = np.array([True, False, True, False])
    z = np.zeros(b, np.float32)
    got = {k: stages.batch(ctx, ro, stages.Scores(z, z > 0, a_seq, a_turn, {}, 0.0, keep=kp), 1).local
           for k, kp in (("all", None), ("kept", keep))}
    trained = got["kept"]["turn_ids"] >= 0
    assert not trained[~keep].any() and trained[keep].any()
    np.testing.assert_array_equal(got["kept"]["turn_ids"][keep], got["all"]["turn_ids"][keep])
    assert (got["all"]["turn_ids"][~keep] >= 0).any()  # the rows left out had tokens to train
