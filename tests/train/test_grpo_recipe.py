"""The GRPO recipe knobs around the loss, against references written from their definitions:

- DAPO's dynamic sampling (Yu et al. 2025, eq. 11: a group trains only when 0 < #correct < G) and
  Mini-o3's masking of trajectories cut by the turn or token budget: which rows train, the counts
  in the metrics, and that a row left out adds nothing to the loss or its denominators;
- the difficulty filter of the RL split (keep prompts with lo < passes/k < hi under the initial
  policy), as a pure function and as the run's stage before step 1 (with a stand-in engine);
- learning-rate warm-up of the GRPO optimizer (`config.optim.warmup_ratio`);
- the run config's blocks -> the library configs, defaults unchanged.
"""

import dataclasses
import json
import types

import jax
import ml_collections
import numpy as np
import pytest

from codedance_jax.errors import ConfigError
from codedance_jax.rl import GRPOLossConfig, RBATConfig, grpo_loss, selection
from codedance_jax.rollout import Trajectory
from codedance_jax.rollout.record import FINISH_REASONS
from configs import grpo as grpo_configs
from runs import grpo as grpo_run
from runs import grpo_stages as stages


def _config(**filters):
    c = grpo_configs.get_config("tiny")
    c.filter.update(filters)
    return c


# ------------------------------------------------------------------ dynamic sampling, masking
def reference_flat_groups(values, g):
    """Row b is in a group (G contiguous rows) whose values are all equal."""
    out = []
    for b in range(len(values)):
        grp = values[b // g * g : b // g * g + g]
        out.append(all(abs(v - grp[0]) <= 1e-6 for v in grp))
    return np.array(out)


def test_dynamic_sampling_drops_the_groups_without_contrast():
    rng = np.random.default_rng(0)
    g, p = 4, 6
    acc = (rng.random(p * g) < 0.5).astype(np.float32)
    acc[:g], acc[g : 2 * g] = 1, 0  # one all-correct, one all-wrong group
    total = acc + rng.choice([0.0, 0.5], p * g)
    total[2 * g : 3 * g] = 1.5  # a mixed-accuracy group could still have equal rewards: not here
    truncated = np.zeros(p * g, bool)
    keep, counts = stages.trained_rows(_config(groups="acc"), acc, total, truncated, g)
    flat = reference_flat_groups(acc, g)
    np.testing.assert_array_equal(keep, ~flat)
    assert counts["filter/groups_dropped"] == flat.sum() / g >= 2
    assert counts["filter/trajectories_trained"] == (~flat).sum()
    keep, counts = stages.trained_rows(_config(groups="reward"), acc, total, truncated, g)
    np.testing.assert_array_equal(keep, ~reference_flat_groups(total, g))
    # Off (the default): every trajectory trains and the metrics row has no filter/* entry.
    assert stages.trained_rows(_config(), acc, total, truncated, g) == (None, {})


def test_truncated_trajectories_are_masked_and_counted():
    # The budget endings of the trajectory record (codedance_jax/rollout/record.py), written out here.
    budget = {"max_turns", "turn_tokens", "new_tokens", "length"}
    assert budget < set(FINISH_REASONS)
    reasons = list(FINISH_REASONS) * 2
    np.testing.assert_array_equal(selection.truncated(reasons), [r in budget for r in reasons])
    rng = np.random.default_rng(1)
    acc = rng.integers(0, 2, len(reasons)).astype(np.float32)
    keep, counts = stages.trained_rows(_config(mask_truncated=True), acc, acc, selection.truncated(reasons), 2)
    np.testing.assert_array_equal(keep, [r not in budget for r in reasons])
    assert counts == {"filter/truncated_masked": 2 * len(budget), "filter/trajectories_trained": keep.sum()}


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean", "seq_sum_norm"])
def test_rows_left_out_add_nothing_to_the_loss(aggregation):
    """`untrained_rows` then the loss (with the step's global denominator) = the loss of the kept rows."""
    from codedance_jax.train.grpo import global_denom

    rng = np.random.default_rng(2)
    b, t, m = 8, 10, 3
    old = np.log(rng.uniform(0.1, 0.9, (b, t))).astype(np.float32)
    new = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    batch = {"loss_mask": mask, "turn_ids": np.where(mask > 0, rng.integers(0, m, (b, t)), -1).astype(np.int32)}
    a_seq, a_turn = rng.normal(size=b).astype(np.float32), rng.normal(size=(b, m)).astype(np.float32)
    keep = rng.random(b) < 0.5
    keep[:2] = True, False
    cfg = GRPOLossConfig(aggregation=aggregation, norm_length=t)
    out = stages.untrained_rows(batch, keep)
    f = lambda lp, bt, k: grpo_loss(lp, old[k], None, mask[k], bt["turn_ids"], a_seq[k], a_turn[k], cfg,  # noqa: E731
                                    denom=global_denom(bt, cfg))[0]
    every = np.arange(b)
    loss, grad = jax.value_and_grad(f)(new, out, every)
    kept = {"loss_mask": mask[keep], "turn_ids": batch["turn_ids"][keep]}
    want = f(new[keep], kept, keep)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert np.all(np.asarray(grad)[~keep] == 0) and np.abs(np.asarray(grad)[keep]).max() > 0
    with pytest.raises(ValueError, match="rows"):
        stages.untrained_rows(batch, keep[:3])


# ------------------------------------------------------------------ difficulty filter
def test_keep_by_pass_rate_against_the_definition():
    rng = np.random.default_rng(3)
    k = 8
    passes = rng.integers(0, k + 1, 200)
    for lo, hi in ((0.0, 1.0), (0.1, 0.75), (0.5, 1.0), (-1.0, 0.5)):  # a bound outside [0, 1]: that side open
        want = [lo < p / k < hi for p in passes]
        np.testing.assert_array_equal(selection.keep_by_pass_rate(passes, k, lo, hi), want)
    np.testing.assert_array_equal(selection.keep_by_pass_rate(np.array([0, 1, 7, 8]), 8, 0.0, 1.0),
                                  [False, True, True, False])
    with pytest.raises(ValueError, match="bounds"):
        selection.keep_by_pass_rate(passes, k, 0.8, 0.2)
    with pytest.raises(ValueError, match="pass counts"):
        selection.keep_by_pass_rate(np.array([9]), k, 0.0, 1.0)


class _Engine:
    """Rolls out `k` one-turn answers per prompt; prompt i answers correctly in its first
    `truth[i]` samples."""

    def __init__(self, truth):
        self.truth, self.calls = truth, 0
        self.cfg = types.SimpleNamespace(max_turns=2)

    def set_model(self, model):
        pass

    def rollout(self, prompt_ids, *, group_size, sandbox, seed_offset):
        self.calls += 1
        out = []
        for pid in prompt_ids:
            i = int(pid.split("@")[0][1:])
            for j in range(group_size):
                ans = "5" if j < self.truth[i] else "7"
                out.append(Trajectory(id=f"{pid}-{j}", prompt_id=pid, group=j, prompt_len=1, tokens=[1, 2],
                                      loss_mask=[0, 1], turn_ids=[-1, 0], logprobs=[0.0, -0.1], temperature=1.0,
                                      images=[], image_grid_thw=[], turn_status=["no_code"],
                                      turns=[{"status": "no_code", "text": f"<answer>{ans}</answer>"}], answer=ans,
                                      finish_reason="answer"))
        return out, None


def _filter_ctx(tmp_path, truth, band=(0.0, 1.0), k=4):
    c = grpo_configs.get_config("tiny")
    c.prompts_per_step = 3
    c.data.filter_pass, c.data.filter_samples = band, k
    source = [{"id": f"p{i}", "question": "How many?", "answer": "5", "meta": "{}", "images": []}
              for i in range(len(truth))]
    ctx = stages.GRPOContext(c, str(tmp_path), None, None, None, None, None, None, RBATConfig.paper(), GRPOLossConfig(),
                             (), source, None, _Engine(truth), None, 0, None)
    rows = []
    run = types.SimpleNamespace(mdef=None, state=types.SimpleNamespace(params=None), start=0,
                                writer=types.SimpleNamespace(write=lambda step, row: rows.append((step, row))))
    return ctx, run, rows


def test_difficulty_filter_stage_keeps_the_prompts_sometimes_solved(tmp_path, monkeypatch):
    monkeypatch.setattr(stages, "rl_prompt", lambda processor, pid, *a: pid)
    monkeypatch.setattr(stages, "rollout_model", lambda *a: None)
    truth = [0, 2, 4, 1, 0, 3, 4]
    ctx, run, rows = _filter_ctx(tmp_path, truth)
    out = grpo_run.filter_prompts(ctx, run)
    kept = [i for i, p in enumerate(truth) if 0 < p < 4]
    assert [r["id"] for r in (out.source[i] for i in range(len(out.source)))] == [f"p{i}" for i in kept]
    assert out.schedule.num_prompts == len(kept) and ctx.engine.calls == 3  # 7 prompts, 3 at a time
    rec = json.loads((tmp_path / "prompt_filter.json").read_text())
    assert rec["passes"] == truth and rec["kept"] == kept
    assert rows[0][0] == 0 and rows[0][1]["filter/prompts_kept"] == len(kept)
    # A resumed run reads the file: no rollouts (its policy is no longer the initial one).
    ctx2, run2, _ = _filter_ctx(tmp_path, [0] * len(truth))
    run2.start = 5
    assert [out2["id"] for out2 in grpo_run.filter_prompts(ctx2, run2).source] == [f"p{i}" for i in kept]
    assert ctx2.engine.calls == 0
    ctx3, run3, _ = _filter_ctx(tmp_path, truth, band=(0.0, 0.5))
    with pytest.raises(ConfigError, match="prompt_filter.json"):
        grpo_run.filter_prompts(ctx3, run3)
    # Off (the default): the context is returned as it is.
    ctx4, run4, _ = _filter_ctx(tmp_path / "x", truth, band=())
    assert grpo_run.filter_prompts(ctx4, run4) is ctx4 and ctx4.engine.calls == 0


# ------------------------------------------------------------------ warm-up
def test_grpo_optimizer_honours_the_warmup_ratio():
    """lr(step) = lr·step/W for step < W = round(warmup_ratio·total_steps), then lr (constant schedule),
    and the first update (step 0, lr 0) leaves the parameters where they are."""
    from codedance_jax.train import optim

    c = grpo_configs.get_config("qwen25vl_7b")
    c.total_steps, c.optim.warmup_ratio = 40, 0.1
    tx, sched = optim.make_optimizer(c.optim, c.total_steps)
    w, lr = 4, c.optim.lr
    for step in range(c.total_steps):
        assert float(sched(step)) == pytest.approx(lr * min(1.0, step / w), rel=1e-6)
    params = {"w": np.ones((2, 3), np.float32)}
    state = tx.init(params)
    grads = {"w": np.full((2, 3), 0.5, np.float32)}
    upd, state = tx.update(grads, state, params)
    assert float(np.abs(np.asarray(upd["w"])).max()) == 0.0
    upd, state = tx.update(grads, state, params)
    assert float(np.abs(np.asarray(upd["w"])).max()) == pytest.approx(lr / w, rel=1e-3)  # Adam: |step| = lr
    assert grpo_configs.get_config("tiny").optim.warmup_ratio == 0.0  # off by default


# ------------------------------------------------------------------ run config -> library configs
def test_config_blocks_build_the_variants_and_default_to_the_paper():
    c = grpo_configs.get_config("qwen25vl_7b")
    budget = int(c.rollout.max_new_tokens)
    assert grpo_run.loss_config(c.loss, max_new_tokens=budget) == GRPOLossConfig()
    assert grpo_run.rbat_config(c.rbat, max_new_tokens=budget) == RBATConfig.paper()
    assert grpo_run.filter_config(c) == {"groups": "off", "mask_truncated": False, "filter_pass": None,
                                         "filter_samples": 8}
    c.loss.update(aggregation="seq_sum_norm", ratio="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
    c.rbat.update(seq_norm="none", overlong_cache=512, turn_stats="all", turn_baseline="turn_loo")
    loss = grpo_run.loss_config(c.loss, max_new_tokens=budget)
    assert (loss.norm_length, loss.ratio, loss.eps_low, loss.eps_high) == (budget, "sequence", 3e-4, 4e-4)
    rb = grpo_run.rbat_config(c.rbat, max_new_tokens=budget)
    assert rb == dataclasses.replace(RBATConfig.paper(), seq_norm="none", overlong_cache=512, overlong_max=budget,
                                     turn_stats="all", turn_baseline="turn_loo")
    c.loss.norm_length, c.rbat.overlong_max = 1000, 2000
    assert grpo_run.loss_config(c.loss).norm_length == 1000
    assert grpo_run.rbat_config(c.rbat).overlong_max == 2000
    c.filter.groups = "accuracy"
    with pytest.raises(ConfigError, match="config.filter.groups"):
        grpo_run.filter_config(c)
    c.filter.groups, c.data.filter_pass = "acc", (0.9, 0.1)
    with pytest.raises(ConfigError, match="config.data.filter_pass"):
        grpo_run.filter_config(c)
    c.loss.aggregation = "sum"
    with pytest.raises(ConfigError, match="config.loss"):
        grpo_run.loss_config(c.loss)
    assert isinstance(c.filter, ml_collections.ConfigDict)


# ------------------------------------------------------------------ KL to the initial policy
def test_kl_term_uses_the_frozen_initial_policy_through_the_stage_and_update():
    """kl_coef > 0: `stages.old_logprobs` adds the reference's log-probs (`ctx.ref_params`, which
    `runs.grpo.open_context` sets to the parameters before any update or restore: the SFT policy of
    init_from), and the update's `kl_ref` is the k3 estimate from them, eq. 3's per-sequence means."""
    from model_helpers import FAST_COMPILE, tiny_small_vocab, train_batch

    from codedance_jax import sharding as shd
    from codedance_jax.train import grpo, optim, sft
    from codedance_jax.train import state as st
    from runs import setup

    cfg = tiny_small_vocab()
    oc = ml_collections.ConfigDict(dict(lr=1e-3, warmup_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-6,
                                        clip_norm=0.0, schedule="constant"))
    tx, sched = optim.make_optimizer(oc, 10)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    mdef, state, sh = st.create_train_state(cfg, tx, mesh, seed=3)
    _, ref_state, _ = st.create_train_state(cfg, tx, mesh, seed=4)  # the "SFT" policy: other weights
    rng = np.random.default_rng(5)
    b = train_batch(rng, cfg, 4, 24, [[(1, 4, 4)], []])
    lm = b["loss_mask"] > 0
    b["turn_ids"] = np.where(lm, rng.integers(0, 2, lm.shape), -1).astype(np.int32)
    b["a_seq"], b["a_turn"] = rng.normal(size=4).astype(np.float32), np.zeros((4, 2), np.float32)
    b["old_logprobs"] = np.zeros(lm.shape, np.float32)
    bsh = sft.batch_shardings(b, mesh)
    arrays = {k: jax.device_put(v, bsh[k]) for k, v in b.items()}
    c = grpo_configs.get_config("tiny")
    c.loss.kl_coef = 0.1
    ctx = stages.GRPOContext(c, "", None, cfg, mesh, None, tx, sched, RBATConfig.paper(),
                             grpo_run.loss_config(c.loss), (), None, None, None, None, 4, None,
                             ref_params=ref_state.params)
    run = types.SimpleNamespace(mdef=mdef, state_sh=sh)
    out = stages.old_logprobs(ctx, run, stages.GRPOBatch(b, arrays, bsh, setup.batch_key(b), 0.0))
    lp_fn = grpo.make_logprob_fn(mdef, sh.params, {k: v for k, v in bsh.items() if k in sft.BATCH_FIELDS}, mesh,
                                 compiler_options=FAST_COMPILE)
    lp_in = {k: v for k, v in b.items() if k in sft.BATCH_FIELDS}
    ref_lp, cur_lp = np.asarray(lp_fn(ref_state.params, lp_in)), np.asarray(lp_fn(state.params, lp_in))
    np.testing.assert_allclose(np.asarray(out.arrays["ref_logprobs"]), ref_lp, atol=1e-6)
    step = grpo.make_grpo_step(mdef, tx, sched, ctx.loss, sh, out.shardings, mesh, old_from_forward=True,
                               compiler_options=FAST_COMPILE)
    _, m = step(state, out.arrays, jax.random.key(0))
    mask = lm & (b["turn_ids"] >= 0)
    d = ref_lp.astype(np.float64) - cur_lp
    k3 = np.exp(d) - d - 1
    want = np.mean([k3[i][mask[i]].mean() for i in range(4) if mask[i].any()])
    assert float(m["kl_ref"]) == pytest.approx(want, rel=1e-4) and want > 1e-3
