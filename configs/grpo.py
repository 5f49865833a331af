r"""GRPO run configs (paper section 5: bf16, 256 prompts x n = 8, max 6 turns; R_BAT γ = 4, δ = 0.2, β = 0.2).

  python -m launch.grpo --config=configs/grpo.py:tiny --workdir=/tmp/grpo_tiny
  python -m launch.grpo --config=configs/grpo.py:qwen25vl_7b --workdir=gs://bucket/grpo7b \
      --config.init_from=/ckpt/sft7b/policy --config.data.jsonl=/data/rl_prompts.jsonl \
      --config.data.eval_jsonl=/data/rl_eval.jsonl

Any field can be overridden on the command line: --config.rbat.mode=no_turn --config.group_size=4.

Policy-gradient variants and recipe knobs (every default is the paper's recipe; `launch.ablate
--variants=...` trains one row per named set of them, runs/demo/variants.py):
  Dr. GRPO (Liu et al. 2025)  --config.rbat.seq_norm=none --config.loss.aggregation=seq_sum_norm
  DAPO (Yu et al. 2025)       --config.loss.clip_eps_high=0.28 --config.loss.aggregation=token_mean
                              --config.rbat.overlong_cache=... --config.filter.groups=acc
  GSPO (Zheng et al. 2025)    --config.loss.ratio=sequence --config.loss.clip_eps_low=3e-4 --config.loss.clip_eps_high=4e-4
  Mini-o3 masking             --config.filter.mask_truncated=True
  R_turn baseline             --config.rbat.turn_stats=all --config.rbat.turn_baseline=turn_loo
  difficulty filter           --config.data.filter_pass=0.0,1.0 --config.data.filter_samples=8
"""

import ml_collections


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = preset  # toy | tiny | qwen25vl_3b | qwen25vl_7b: random init when init_from is empty
    # The update's batch layouts in the run's shape plan (runs/grpo_plan.py; all compiled before step
    # 1): packed rows of T n / 16 slots for n in pack_sixteenths, with vision_rows shared vision rows
    # (-1: a quarter of the batch rows), else unpacked rows with per-row images. images=False: the
    # RL prompts are text only (batches without vision fields).
    c.plan = ml_collections.ConfigDict(dict(pack_sixteenths=(12,), vision_rows=-1, images=True))
    c.init_from = ""  # policy: HF or converted checkpoint dir (an SFT run writes WORKDIR/policy)
    c.processor_dir = ""  # tokenizer/preprocessor when init_from is empty ("" = the toy world's)
    c.dtype = "bfloat16"
    c.param_dtype = "float32"
    c.remat = "full"
    # Training-forward attention: xla | flash (Pallas TPU kernel) | auto (flash on TPU; model/flash.py).
    c.attention = "auto"
    c.seed = 0

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.sharding_rules = ()
    # Largest fraction of parameter elements allowed to keep a dimension unsharded because the mesh
    # does not divide it (codedance_jax.sharding.param_shardings raises past it, naming them).
    c.sharding_tolerance = 0.02

    c.prompts_per_step = 256  # global
    c.group_size = 8  # n rollouts per prompt
    c.total_steps = 100
    c.grad_accum = 16
    # warmup_ratio: linear warm-up of the learning rate over round(warmup_ratio * total_steps) steps (0 = off, the
    # paper's RL recipe; `train.optim.make_optimizer`, as SFT).
    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-6, warmup_ratio=0.0, schedule="constant", min_lr_ratio=0.0, weight_decay=0.0,
        b1=0.9, b2=0.999, eps=1e-8, clip_norm=1.0,
        freeze=(),  # parameter groups without updates, e.g. ("visual",) (`train.optim`)
    ))
    # R_BAT (SPEC section 4): preset paper | release; mode full | no_turn | tool_bonus | outcome.
    # seq_eps / w_turn: None keeps the preset's value (paper: 1e-6 and 1; release: 1e-6 and 0.2). A larger
    # seq_eps damps groups whose rewards barely differ (A_seq = (r - mean) / (std + seq_eps)).
    #
    # seq_norm: A_seq = (r - mean_G) / (std_G + eps) ("std", eq. 4) or r - mean_G ("none": Dr. GRPO, Liu et al.
    #   2025, "Understanding R1-Zero-Like Training", which drops the std that up-weights too easy/hard groups).
    # overlong_cache / overlong_max: DAPO's (Yu et al. 2025, eq. 13) soft overlong punishment added to r(tau):
    #   0 up to L_max - L_cache sampled tokens |y|, then ((L_max - L_cache) - |y|) / L_cache down to -1 at L_max.
    #   L_cache = overlong_cache tokens (0 = off); L_max = overlong_max (None = rollout.max_new_tokens).
    # turn_stats: the turns whose discounted returns R^m enter mu_batch, sigma_batch of A_turn^m = (R^m - mu)/sigma
    #   (paper eq. 2) and get an A_turn: "tool" (SPEC [decided]) or "all" (every turn taken, the final answer turn
    #   with r^m = 0 included: the appendix's "successful or no-code turns receive r_turn = 0").
    # turn_baseline: mu, sigma over the batch ("batch", eq. 2) or leaving the trajectory out ("turn_loo": mu per turn
    #   index m over the other trajectories, sigma over all their turns; unbiased in direction,
    #   benchmarks/results/rturn_bias/README.md).
    # mastered: where d(mu) < 0 may penalise tool calls: every mastered group ("group", the paper) or only a group
    #   whose direct (no-tool) rollouts exist and are all right ("direct"; issue 47 P6: under "group" a hard group
    #   solved by cropping is mastered too, and a lucky guess out-scores a correct crop).
    c.rbat = ml_collections.ConfigDict(dict(preset="paper", mode="full", gamma=4.0, delta=0.2, beta=0.2, mastered="group",
                                            seq_eps=ml_collections.FieldReference(None, field_type=float),
                                            w_turn=ml_collections.FieldReference(None, field_type=float),
                                            seq_norm="std", overlong_cache=0,
                                            overlong_max=ml_collections.FieldReference(None, field_type=int),
                                            turn_stats="tool", turn_baseline="batch"))
    # The clipped objective (paper eq. 3; codedance_jax.rl.grpo_loss):
    # clip_eps: epsilon, r_{i,t} clipped to [1 - eps_low, 1 + eps_high]; clip_eps_low / clip_eps_high (None = clip_eps)
    #   decouple the two sides (DAPO's "clip-higher": eps_low 0.2, eps_high 0.28).
    # aggregation: "seq_mean" = 1/G sum_i 1/|o_i| sum_t (eq. 3); "token_mean" = 1/sum_i |o_i| sum_i sum_t (DAPO's
    #   token-level loss); "seq_sum_norm" = 1/G sum_i 1/L sum_t with the constant L = norm_length (Dr. GRPO; None =
    #   rollout.max_new_tokens, the generation budget).
    # ratio: "token" r_{i,t} = pi/pi_old per token (eq. 3); "sequence" = GSPO's (Zheng et al. 2025) length-normalized
    #   s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|), clipped, times each token's own advantage (GSPO-token; GSPO clips at
    #   eps_low 3e-4, eps_high 4e-4).
    # kl_coef: beta_KL of the k3 KL to the frozen initial policy (the SFT policy given as init_from); 0 = off (paper).
    c.loss = ml_collections.ConfigDict(dict(clip_eps=0.2,
                                            clip_eps_low=ml_collections.FieldReference(None, field_type=float),
                                            clip_eps_high=ml_collections.FieldReference(None, field_type=float),
                                            aggregation="seq_mean",
                                            norm_length=ml_collections.FieldReference(None, field_type=int),
                                            ratio="token", kl_coef=0.0))
    # Which trajectories train (codedance_jax.rl.selection); both counted in the metrics (filter/*):
    # groups: DAPO's dynamic sampling: "acc" drops the groups whose accuracies are all equal (0 or G correct),
    #   "reward" those whose sequence rewards r(tau) are all equal; dropped from the loss, not resampled ("off").
    # mask_truncated: Mini-o3's masking: trajectories that hit the turn or token budget without an answer
    #   (finish_reason max_turns / turn_tokens / new_tokens / length) contribute no loss.
    c.filter = ml_collections.ConfigDict(dict(groups="off", mask_truncated=False))
    # True: the old log-probs are the trainer's (the update's own forward, as a verl recompute would give
    # with one update per batch; `logprob_mismatch` checks them against the sampler's); False: the sampler's.
    c.recompute_old_logprobs = True
    # async_rollout: 1 samples step k+1's rollouts with step k's pre-update weights (a sampler copy of its own) in
    #   a background thread while step k's update runs (runs/grpo_overlap.py): one step off-policy, the ratio taken
    #   against the trajectories' recorded log-probs (so recompute_old_logprobs is overridden to False); each
    #   metrics row records `staleness` (0 or 1) and time/rollout_start/_end, time/update_start/_end. 0: off.
    c.async_rollout = 0

    # mesh_data: the sampling mesh, per process: rollout rows split over this many of the process's own devices
    #   (jax.local_devices(); -1 = all of them), the policy replicated over them and placed there device to device
    #   each step (codedance_jax/rollout/placement.py). batch_multiple must be a multiple of it: 8 covers hosts of
    #   1, 2, 4 or 8 devices. The placement is recorded per step in WORKDIR/rollout_stats.jsonl.
    # mesh_tensor: the policy's weights split over groups of this many of those devices (attention heads, MLP
    #   columns and vocabulary; the KV cache by KV heads), for a policy larger than one chip; mesh_data = -1 then
    #   means the local devices / mesh_tensor, which it must divide. 1: every device holds the whole policy.
    c.rollout = ml_collections.ConfigDict(dict(
        turn_format="code", max_turns=6, max_turn_tokens=1024, max_new_tokens=4096, max_total_tokens=8192,
        decode_chunk=32, batch_multiple=8, prompt_buckets=(1024, 2048, 4096), obs_buckets=(256, 1024),
        obs_max_pixels=1024 * 28 * 28, temperature=1.0, top_p=1.0, top_k=0, append_min_frac=0.5,
        cache_grow=0,  # > 0: the KV cache starts this small and grows by it (`RolloutConfig.cache_grow`)
        mesh_data=-1, mesh_tensor=1,
    ))
    c.sandbox = ml_collections.ConfigDict(dict(num_workers=16, timeout_s=15.0, memory_mb=2048))
    # GRPO batches are padded to the first (tokens, image tokens, windows) bucket that fits.
    c.buckets = ((4096, 2048, 128), (8192, 4096, 256))

    c.data = ml_collections.ConfigDict(dict(
        jsonl=(),  # RL prompt JSONL files (data/rl_prompts.py format)
        eval_jsonl=(),  # held-out prompts evaluated every eval_every steps
        tfds_dir="",  # "" = WORKDIR/tfds
        name="rl", eval_name="rl_eval",
        toyworld=False,  # no jsonl given: generate the toy world (data/toyworld) into WORKDIR/world
        toy_sizes=(64, 64, 48),  # (sft, rl, eval) items when the toy world is generated here
        # Difficulty filter of the RL split (the release's filtered data): before step 1 the initial policy
        # samples filter_samples (k) rollouts of every RL prompt; prompts whose pass rate lies strictly inside
        # (lo, hi) = filter_pass are kept, e.g. (0.0, 1.0) = those it sometimes gets right (a bound outside [0, 1]
        # leaves that side open: (-1.0, 0.5) keeps the never-solved ones too). () = off.
        filter_pass=(), filter_samples=8,
    ))
    c.eval = ml_collections.ConfigDict(dict(every=20, max_turns=10, limit=0, batch=64, at_start=False))
    c.metric_keys = ("difficulty",)  # prompt metadata keys to break accuracy/tool use down by
    c.trajectories_every = 0  # >0: write the step's trajectories + the sampling policy every N steps
    c.checkpoint = ml_collections.ConfigDict(dict(every_steps=10, keep=3, async_save=True))
    c.log_every = 1
    c.tensorboard = True
    c.peak_tflops_per_device = 989.0

    if preset in ("tiny", "toy"):
        c.model = "toy"
        c.dtype, c.remat = "float32", "none"
        c.prompts_per_step, c.group_size, c.total_steps, c.grad_accum = 4, 4, 4, 1
        c.optim.lr, c.optim.warmup_ratio = 5e-4, 0.0
        c.rollout.update(max_turns=3, max_turn_tokens=48, max_new_tokens=128, max_total_tokens=448,
                         decode_chunk=16, batch_multiple=8, prompt_buckets=(256,), obs_buckets=(128,),
                         obs_max_pixels=112 * 112)
        c.sandbox.update(num_workers=2, timeout_s=10.0, memory_mb=1024)
        # One bucket of each kind: each is a set of programs in the shape plan (runs/grpo_plan.py),
        # compiled before step 1, and this preset only shows the mechanics.
        c.buckets = ((512, 160, 40),)
        c.data.toyworld = True
        c.data.toy_sizes = (0, 16, 8)
        c.eval.update(every=2, max_turns=3, limit=8, batch=8)
        c.checkpoint.update(every_steps=2, async_save=False)
        c.tensorboard = False
        c.peak_tflops_per_device = 0.16
    elif preset == "qwen25vl_3b":
        c.model = "qwen25vl_3b"
    elif preset != "qwen25vl_7b":
        raise ValueError(f"unknown preset {preset!r}: tiny | qwen25vl_3b | qwen25vl_7b")
    return c
