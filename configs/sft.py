r"""SFT run configs (paper section 5: batch 128, lr 5e-5, warmup ratio 0.05, cosine).

  python -m launch.sft --config=configs/sft.py:tiny --workdir=/tmp/sft_tiny
  python -m launch.sft --config=configs/sft.py:qwen25vl_7b --workdir=gs://bucket/sft7b \
      --config.init_from=/ckpt/Qwen2.5-VL-7B-Instruct --config.data.jsonl=/data/codedance_sft.jsonl

Any field can be overridden on the command line: --config.optim.lr=1e-5 --config.mesh.fsdp=16.
"""

import ml_collections


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # toy | tiny | qwen25vl_3b | qwen25vl_7b (ignored when init_from is set). `toy` without init_from or
    # processor_dir: the toy world's layout with a byte-level BPE trained on the run's own texts.
    c.model = preset
    c.init_from = ""  # HF or converted checkpoint directory; "" = random init (tiny)
    c.processor_dir = ""  # tokenizer/preprocessor files when init_from is empty
    c.dtype = "bfloat16"  # compute dtype; master weights stay in param_dtype
    c.param_dtype = "float32"
    c.remat = "full"  # none | full | dots
    # Training-forward attention: xla | flash (Pallas TPU kernel) | auto (flash on TPU; model/flash.py).
    c.attention = "auto"
    c.seed = 0

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    # Logical axis -> mesh axes; empty tuple = codedance_jax.sharding.DEFAULT_RULES.
    c.sharding_rules = ()
    # Largest fraction of parameter elements allowed to keep a dimension unsharded because the mesh
    # does not divide it (codedance_jax.sharding.param_shardings raises past it, naming them).
    c.sharding_tolerance = 0.02

    # The gradient's divisor: 0 = the batch's loss-token count (the token mean); N > 0 = the constant N, so every
    # loss token of the data weighs the same whatever batch it lands in (set it near the mean loss tokens per
    # batch; codedance_jax/train/sft.py).
    c.norm_tokens = 0
    c.batch_size = 128  # global, in trajectories
    c.grad_accum = 8
    c.total_steps = 265  # ~1 epoch of 34K trajectories at batch 128
    c.optim = ml_collections.ConfigDict(dict(
        lr=5e-5, warmup_ratio=0.05, schedule="cosine", min_lr_ratio=0.0, weight_decay=0.0,
        b1=0.9, b2=0.999, eps=1e-8, clip_norm=1.0,
    ))

    c.data = ml_collections.ConfigDict(dict(
        jsonl=(),  # trajectory JSONL files (see WORKSPACE.md, "SFT trajectory format")
        tfds_dir="",  # where the array_record dataset is built/read; "" = WORKDIR/tfds
        name="sft",
        synthetic=0,  # >0: generate this many synthetic trajectories when jsonl is empty
        on_error="skip",  # skip-and-count malformed records, or "stop"
        turn_format="code",  # code (<code>/<interpreter>) | tool_call (release)
        max_pixels=12845056,
        buckets=((2048, 1024, 64), (4096, 2048, 128), (8192, 4096, 256)),  # (tokens, image tokens, windows)
        group_window=8,  # group examples by bucket within windows of this many batches (1 = off)
        # Pack each batch's examples several to a row of this (tokens, image tokens, windows) shape,
        # at least the largest bucket in every field (segment-masked; same examples, same loss); () = off.
        pack=(),
        pack_row_multiple=1,  # packed batches have a multiple of this many rows per host (fewer shapes)
        # Keep featurized examples (decoded, processed pixels and tokens) in memory up to this many
        # MB per host, so later epochs skip featurization; 0 = off (real datasets exceed any cache).
        cache_mb=0,
    ))
    c.checkpoint = ml_collections.ConfigDict(dict(every_steps=50, keep=3, async_save=True))
    c.export_policy = True  # write WORKDIR/policy (a converted checkpoint) when training ends
    c.log_every = 1
    c.tensorboard = True
    c.peak_tflops_per_device = 989.0  # H100/H200 bf16 dense; set for your hardware (MFU)

    if preset == "tiny":
        # The toy layout (~1k-row vocabulary trained on the data) rather than ModelConfig.tiny's 152k
        # Qwen rows, which made each step, checkpoint and export ~10x dearer; --config.model=tiny
        # keeps the real Qwen tokenizer.
        c.model = "toy"
        c.dtype = "float32"
        c.remat = "none"
        c.batch_size, c.grad_accum, c.total_steps = 8, 1, 20
        c.optim.lr, c.optim.warmup_ratio = 3e-3, 0.1
        c.data.synthetic = 16
        c.data.max_pixels = 112 * 112
        c.data.buckets = ((128, 16, 8), (256, 32, 16))
        c.checkpoint.every_steps = 5
        c.peak_tflops_per_device = 0.26 / 8  # measured fp32 matmul on this 2-core CPU, split over 8 virtual devices
    elif preset == "qwen25vl_3b":
        c.model = "qwen25vl_3b"
    elif preset != "qwen25vl_7b":
        raise ValueError(f"unknown preset {preset!r}: tiny | qwen25vl_3b | qwen25vl_7b")
    return c
