"""What a rollout may spend and what it spent: `RolloutConfig` (turn and token budgets, shape
buckets, observation limits, overlap) and `RolloutStats` (wall-clock accounting per stage).
Both are plain data; `engine.RolloutEngine` reads the one and fills the other."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Budgets, buckets and observation limits of a rollout.

    max_turns M: assistant turns per trajectory (6 train, 10 eval). max_turn_tokens: sampled tokens
    per turn; max_new_tokens: sampled tokens per trajectory; max_total_tokens: the whole sequence
    (prompt, sampled and observation tokens). decode_chunk: decode steps per device call (the host
    checks stops, submits code and appends observations between calls).
    """

    turn_format: str = "code"
    max_turns: int = 6
    max_turn_tokens: int = 1024
    max_new_tokens: int = 4096
    max_total_tokens: int = 8192
    decode_chunk: int = 32
    batch_multiple: int = 8
    prompt_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    obs_buckets: tuple[int, ...] = (64, 256, 1024)
    vision_min_units: int = 64
    obs_max_chars: int = 2000
    obs_max_images: int = 4
    # Images per prompt the shape plan makes room for (`shapes.RolloutPlan`); a prompt with more
    # still runs, in a vision shape outside the plan (one compilation, reported).
    prompt_images: int = 1
    # At most this many observation images are encoded in one append (0: every ready row's, up to
    # rows x obs_max_images); rows past it wait for the next append. It bounds the plan's vision
    # shape at scale (thousands of rows x four images of a megapixel each would be one call).
    append_images: int = 0
    obs_max_pixels: int = 1024 * 28 * 28
    overlap: bool = True
    # Overlap mode appends ready observations while other rows still decode only once at least this
    # share of the rows with a cell in flight or done is ready (0 = at once). Each append runs the
    # whole batch through the model for the chunk, so batching appends saves device time.
    append_min_frac: float = 0.0
    cache_len: int | None = None  # default: max_total_tokens + the larger of decode_chunk and obs bucket
    # > 0: the KV cache starts with this many slots and grows by it (up to cache_slots) when a chunk
    # does not fit, instead of holding every slot from the start. A decode step reads the whole
    # cache, so it costs in proportion to its slots (toy model, 64 rows: 15.5 ms at 640 slots,
    # 5.6 ms at 256); each size compiles the decode and append calls once more.
    cache_grow: int = 0
    exec_deadline_s: float | None = None  # give up on a cell after this long (the pool has its own limit)
    policy: str | None = None  # recorded in each trajectory (the checkpoint that samples)

    @classmethod
    def train(cls, **kw) -> RolloutConfig:
        return cls(**{"max_turns": 6, **kw})

    @classmethod
    def eval(cls, **kw) -> RolloutConfig:
        return cls(**{"max_turns": 10, **kw})

    @classmethod
    def from_block(cls, block, *, evaluation: bool = False, **overrides) -> RolloutConfig:
        """From a run config's `rollout` block (sequences as tuples). Its sampling fields belong to
        `SamplingConfig` and `mesh_data` / `mesh_tensor` to the engine's mesh (`placement.sampling_mesh`);
        any other unknown field is an error, as a misspelt override should be."""
        r = {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in dict(block).items()
             if k not in ("temperature", "top_p", "top_k", "mesh_data", "mesh_tensor")}
        return (cls.eval if evaluation else cls.train)(**{**r, **overrides})

    @property
    def max_obs_tokens(self) -> int:
        return max(self.obs_buckets)

    @property
    def cache_slots(self) -> int:
        return self.cache_len or self.max_total_tokens + max(self.decode_chunk, self.max_obs_tokens)


@dataclasses.dataclass
class RolloutStats:
    """Wall-clock accounting of one rollout (seconds) and counts."""

    wall_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    append_s: float = 0.0
    vision_s: float = 0.0
    device_wait_s: float = 0.0  # the host blocked on the sandbox with nothing to decode
    sandbox_busy_s: float = 0.0  # wall time with at least one cell in flight
    host_s: float = 0.0  # everything else (tokenizing, stop checks, bookkeeping)
    trajectories: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_chunks: int = 0
    appends: int = 0
    executions: int = 0
    compactions: int = 0
    cache_growths: int = 0
    rollbacks: int = 0
    compiles: int = 0
    row_shardings: dict | None = None  # PartitionSpec of the cache / logits at the end (`RolloutEngine(mesh=)`)
    sampling_devices: int = 0  # devices the rollout's cache and parameters lived on (`placement.placement_record`)
    sampling_mesh: dict | None = None  # {axis: size} of the engine's mesh; None without one

    @property
    def device_idle_frac(self) -> float:
        """Fraction of wall time the device waited for the sandbox."""
        return self.device_wait_s / self.wall_s if self.wall_s else 0.0

    @property
    def sandbox_idle_frac(self) -> float:
        """Fraction of wall time with no cell in flight (the sandbox waited for the device)."""
        return 1.0 - self.sandbox_busy_s / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(device_idle_frac=self.device_idle_frac, sandbox_idle_frac=self.sandbox_idle_frac)
        return d
