"""R_BAT: the sequence- and turn-level advantages of CodeDance (paper eq. 1, 2, 4, 5; SPEC §4).

One jit-compiled, vectorized kernel turns per-trajectory outcomes into the two advantages GRPO
needs: `a_seq[b]` (broadcast to every trained token of trajectory b) and `a_turn[b, m]` (added to
the tokens of turn m only). The advantage of a trained token in turn m is `a_seq[b] + a_turn[b, m]`.

Guarantees:
- no Python loop over the batch: the group statistics come from a `[P, G]` reshape, the discounted
  turn returns from a `[M, M]` discount matrix, the batch statistics from masked sums;
- every statistic is a plain reduction inside `jit`, so on arrays sharded over a mesh (any number
  of hosts) XLA inserts the all-reduces and the numbers are those of the global batch — the same as
  on one device (tested on an 8-device CPU mesh);
- float32 throughout, whatever the input dtypes.

Two presets (see WORKSPACE.md, "R_BAT presets"): `paper` follows the paper's equations with the
SPEC's [decided] points; `release` reproduces the authors' public verl fork. Deviations of the
`paper` preset from the paper's text: the ε = 1e-6 in both normalizations (the paper divides by a
bare std, which is 0/0 for a group of identical rewards) and `R_seq = 0` when a trajectory made no
tool call (the paper's N_succ/N_total is 0/0 there).

Switches beyond the two presets (all off by default, i.e. the paper's equations): A_seq without the
std division (`seq_norm="none"`, Dr. GRPO), DAPO's overlong reward shaping (`overlong_cache`, needs
`resp_len`), which turns enter R_turn's statistics (`turn_stats`, "all" needs `turn_valid`) and
where its baseline comes from (`turn_baseline`: the batch, or per turn index leaving the turn's own
trajectory out, which keeps the policy gradient's direction unbiased; benchmarks/results/rturn_bias/).

What the kernel cannot see: *which* executions count as failed. That is decided on the host, per
preset, by `turn_failed_from_execution` (the release also counts "no output" and any "Error" /
"timeout" text in the observation), and enters the kernel through `turn_failed`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from codedance_jax.errors import ConfigError
from codedance_jax.rl.registry import register_advantage

Mode = Literal["outcome", "tool_bonus", "no_turn", "full"]
MODES: tuple[str, ...] = ("outcome", "tool_bonus", "no_turn", "full")

# The release's sandbox prints this when a cell produced neither stdout nor a figure; its reward
# code counts such a call as failed (`llm_judge_qwen_tool_step.py`, `error_strings`).
RELEASE_NO_OUTPUT_MESSAGE = "Code executed successfully. No explicit output or figures produced."


@dataclasses.dataclass(frozen=True)
class RBATConfig:
    """Hyper-parameters of R_acc + R_format + R_BAT and of the advantage normalizations.

    Frozen and hashable: it is a static argument of the jitted kernel. Override a field with
    `dataclasses.replace(RBATConfig.paper(), gamma=5.0)`.
    """

    # --- which Table 3 row -------------------------------------------------------------------
    mode: Mode = "full"
    """Ablation row of the paper's Table 3: "outcome" (GRPO on R_acc + R_format only),
    "tool_bonus" (DeepEyes-style: + w_tool_bonus when the answer is correct and a tool call
    succeeded), "no_turn" (R_BAT without R_turn: a_turn ≡ 0), "full" (R_BAT)."""

    # --- outcome reward ----------------------------------------------------------------------
    w_acc: float = 1.0
    """Weight of R_acc ∈ {0, 1} in r(τ) (1 in the paper; the release's math scorer uses 1.2)."""
    format_style: Literal["bonus", "penalty"] = "bonus"
    """R_format: "bonus" adds +w_format when compliant (SPEC [decided]); "penalty" subtracts
    w_format when malformed (the release: score = acc − 0.2·malformed)."""
    w_format: float = 0.5
    """w_format: the format bonus (paper preset) or penalty weight (release preset, 0.2)."""

    # --- sequence level: R_seq = c(acc) · d(μ_acc) · N_succ/N_total (eq. 1/5) ------------------
    difficulty: Literal["sigmoid", "tanh"] = "sigmoid"
    """d(μ_acc): "sigmoid" = σ(γ(0.5 − μ_acc)) − δ (paper); "tanh" = (1 + tanh(γ(0.5 − μ_acc)))/2 − δ
    (release; equals σ(2γ(0.5 − μ_acc)) − δ, i.e. a transition twice as sharp)."""
    gamma: float = 4.0
    """γ: sharpness of the difficulty factor d."""
    delta: float = 0.2
    """δ: shift of d; d < 0 (tool calls discouraged) only above μ* = 0.5 − σ⁻¹(δ)/γ."""
    mu_acc_source: Literal["accuracy", "score"] = "accuracy"
    """μ_acc: group mean of 1{R_acc > 0} ("accuracy", paper) or of the outcome score
    w_acc·R_acc + R_format ("score", release, where the score carries the format penalty)."""
    mastered: Literal["group", "direct"] = "group"
    """Where d(μ) < 0 (above μ*: the group is mastered) may penalise tool calls. "group" (paper):
    every mastered group. "direct": only a group whose rollouts without a tool call exist and are all
    correct (a tool call there is redundant); elsewhere d is clipped at 0. With "group", a hard group
    solved by its tool calls is mastered too, so a lucky direct guess out-scores a correct tool call
    (issue 47, P6)."""
    tool_weight_correct: float = 1.0
    """c(acc=1): weight of the success ratio when the answer is correct (paper 0.5 + 0.5 = 1.0;
    release 1.5)."""
    tool_weight_wrong: float = 0.5
    """c(acc=0): weight of the success ratio when the answer is wrong (0.5 in both)."""
    w_tool_bonus: float = 1.0
    """DeepEyes-style bonus (mode "tool_bonus" only): + w_tool_bonus if R_acc > 0 and at least one
    tool call succeeded."""

    # --- A_seq: GRPO group normalization (eq. 4) ---------------------------------------------
    seq_std_ddof: int = 0
    """Degrees of freedom of the group std: 0 = population std (paper/SPEC), 1 = unbiased
    (`torch.std`, release)."""
    seq_eps: float = 1e-6
    """ε of A_seq = (r − mean_G) / (std_G + ε)."""
    singleton_group_unit: bool = False
    """Release (verl) rule for a group of one: mean 0, std 1, so A_seq = r. Otherwise a group of one
    gets A_seq = 0 (no contrast)."""
    seq_norm: Literal["std", "none"] = "std"
    """Scale of A_seq: "std" = (r − mean_G) / (std_G + ε) (eq. 4, GRPO); "none" = r − mean_G (Dr. GRPO,
    Liu et al. 2025, "Understanding R1-Zero-Like Training": dividing by std_G up-weights the groups
    whose rewards barely differ, i.e. questions too easy or too hard)."""

    # --- overlong reward shaping (DAPO, Yu et al. 2025, eq. 13) -------------------------------
    overlong_cache: int = 0
    """L_cache: DAPO's soft overlong punishment over the last L_cache tokens of the budget, added to
    the sequence reward r(τ) (so A_seq sees it; μ_acc does not): R_length = 0 for |y| ≤ L_max − L_cache,
    ((L_max − L_cache) − |y|) / L_cache up to |y| = L_max (−1 there), −1 beyond. |y| = the trajectory's
    sampled tokens (`resp_len`). 0 = off (the paper)."""
    overlong_max: int = 0
    """L_max of the overlong shaping (the run config's default: rollout.max_new_tokens)."""

    # --- turn level: r^m, R^m = r^m + β R^{m+1}, A_turn^m (eq. 2) --------------------------------
    fail_penalty: float = -0.5
    """r_turn^m for a failed execution (0 otherwise)."""
    beta: float = 0.2
    """β: discount of the turn returns, accumulated from the last turn backwards."""
    turn_eps: float = 1e-6
    """ε of A_turn = (R − μ_batch) / (σ_batch + ε) (paper preset; population std)."""
    turn_norm: Literal["eps", "raw_if_constant"] = "eps"
    """"eps": divide by σ_batch + ε (paper/SPEC). "raw_if_constant": divide by σ_batch, but when
    σ_batch ≤ turn_std_floor use the raw returns un-normalized (release `batch.py`)."""
    turn_std_floor: float = 1e-8
    """σ threshold of the "raw_if_constant" rule."""
    w_turn: float = 1.0
    """Weight of A_turn in the token advantage (paper 1; release 0.2)."""
    turn_stats: Literal["tool", "all"] = "tool"
    """Which turns enter R_turn's statistics and get an A_turn: "tool" = the tool-call turns (SPEC
    [decided]; the release: its non-final steps); "all" = every turn a trajectory took, its final
    answer turn (r = 0, R = 0) included: the paper's appendix reads "successful or no-code turns
    receive r_turn = 0" and normalizes "the per-turn penalties" into A_turn^m (needs `turn_valid`)."""
    turn_baseline: Literal["batch", "turn_loo"] = "batch"
    """Where μ and σ of A_turn^m = (R^m − μ)/σ come from: "batch" = one mean and std over the selected
    turns of the global batch (eq. 2); "turn_loo" = μ per turn index m over the *other* trajectories'
    turns m, σ over all the other trajectories' selected turns (leave one trajectory out), so neither
    depends on the trajectory's own actions and the turn-level policy gradient is unbiased in
    direction (benchmarks/results/rturn_bias/). When the others hold fewer than 2 turns or their std
    ≤ max(turn_std_floor, 1e-3·|fail_penalty|) (float32 noise of a zero spread), R^m − μ_{-i} is used
    unscaled."""

    # --- which executions failed (host side, `turn_failed_from_execution`) -------------------
    fail_on_no_output: bool = False
    """Release: an execution that printed nothing and showed no image counts as failed."""
    failure_markers: tuple[str, ...] = ()
    """Release: an execution whose observation text contains any of these substrings counts as
    failed ("Error", "timeout", and the release sandbox's no-output message), case-sensitive as
    in the release."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"RBATConfig.mode={self.mode!r}: expected one of {MODES}")
        if self.format_style not in ("bonus", "penalty"):
            raise ConfigError(f"RBATConfig.format_style={self.format_style!r}: expected 'bonus' or 'penalty'")
        if self.difficulty not in ("sigmoid", "tanh"):
            raise ConfigError(f"RBATConfig.difficulty={self.difficulty!r}: expected 'sigmoid' or 'tanh'")
        if self.mu_acc_source not in ("accuracy", "score"):
            raise ConfigError(f"RBATConfig.mu_acc_source={self.mu_acc_source!r}: expected 'accuracy' or 'score'")
        if self.turn_norm not in ("eps", "raw_if_constant"):
            raise ConfigError(f"RBATConfig.turn_norm={self.turn_norm!r}: expected 'eps' or 'raw_if_constant'")
        if self.seq_std_ddof not in (0, 1):
            raise ConfigError(f"RBATConfig.seq_std_ddof={self.seq_std_ddof}: expected 0 or 1")
        if self.mastered not in ("group", "direct"):
            raise ConfigError(f"RBATConfig.mastered={self.mastered!r}: expected 'group' or 'direct'")
        if self.seq_norm not in ("std", "none"):
            raise ConfigError(f"RBATConfig.seq_norm={self.seq_norm!r}: expected 'std' or 'none'")
        if self.turn_stats not in ("tool", "all"):
            raise ConfigError(f"RBATConfig.turn_stats={self.turn_stats!r}: expected 'tool' or 'all'")
        if self.turn_baseline not in ("batch", "turn_loo"):
            raise ConfigError(f"RBATConfig.turn_baseline={self.turn_baseline!r}: expected 'batch' or 'turn_loo'")
        if self.overlong_cache < 0 or (self.overlong_cache and self.overlong_max <= self.overlong_cache):
            raise ConfigError(f"RBATConfig.overlong_cache={self.overlong_cache}, overlong_max={self.overlong_max}: "
                              "need 0 (off) or 0 < L_cache < L_max (set overlong_max to the token budget)")

    @classmethod
    def paper(cls, **overrides) -> RBATConfig:
        """The paper's equations with the SPEC's [decided] points (the default)."""
        return cls(**overrides)

    @classmethod
    def release(cls, **overrides) -> RBATConfig:
        """The authors' public verl fork (CodeDance-VL/CodeDance), default (non-math) scorer."""
        fields = dict(
            format_style="penalty",
            w_format=0.2,
            difficulty="tanh",
            mu_acc_source="score",
            tool_weight_correct=1.5,
            tool_weight_wrong=0.5,
            seq_std_ddof=1,
            singleton_group_unit=True,
            turn_norm="raw_if_constant",
            w_turn=0.2,
            fail_on_no_output=True,
            failure_markers=("Error", "timeout", RELEASE_NO_OUTPUT_MESSAGE),
        )
        fields.update(overrides)
        return cls(**fields)


def turn_failed_from_execution(status: str, observation: str = "", n_images: int = 0, *, cfg: RBATConfig) -> bool:
    """Whether one executed code block counts as failed, per preset.

    status: the sandbox's "ok" | "error" | "timeout" | "crashed". observation: the text fed back
    (stdout, stderr, status line). Both presets fail error/timeout/crash; the release also fails an
    "ok" execution with no output at all, or whose observation text contains a failure marker.
    """
    if status not in ("ok", "error", "timeout", "crashed"):
        raise ValueError(f"turn status {status!r}: expected ok/error/timeout/crashed for an executed turn")
    if status != "ok":
        return True
    if cfg.fail_on_no_output and not observation.strip() and n_images == 0:
        return True
    return any(marker in observation for marker in cfg.failure_markers)


def turn_arrays(turns: Sequence[Sequence[dict]], *, max_turns: int, cfg: RBATConfig) -> tuple[np.ndarray, np.ndarray]:
    """Host-side packing of per-trajectory turn records into the kernel's `turn_is_tool, turn_failed`.

    turns[b][m] is a dict with "status" (ok/error/timeout/crashed/no_code, as in the trajectory
    record) and optionally "observation" (str) and "n_images" (int). Returns bool[B, M] arrays,
    padded with False/False. A trajectory with more than `max_turns` turns is an error.
    """
    b = len(turns)
    is_tool = np.zeros((b, max_turns), bool)  # [B, M]
    failed = np.zeros((b, max_turns), bool)  # [B, M]
    for i, traj in enumerate(turns):
        if len(traj) > max_turns:
            raise ValueError(f"trajectory {i} has {len(traj)} turns > max_turns={max_turns}; raise max_turns")
        for m, t in enumerate(traj):
            if t["status"] == "no_code":
                if m != len(traj) - 1:
                    raise ValueError(f"trajectory {i}: turn {m} has no code but is not the last turn")
                continue
            is_tool[i, m] = True
            failed[i, m] = turn_failed_from_execution(
                t["status"], t.get("observation", ""), t.get("n_images", 0), cfg=cfg
            )
    return is_tool, failed


def _group_normalize(r_pg: jax.Array, cfg: RBATConfig) -> jax.Array:
    """A_seq within each group: (r − mean) / (std + ε), std with cfg.seq_std_ddof."""
    g = r_pg.shape[1]
    if g == 1:
        # A group of one has no contrast: 0 (paper); verl's mean 0, std 1 keeps r itself (release).
        if not cfg.singleton_group_unit:
            return jnp.zeros_like(r_pg)
        return r_pg if cfg.seq_norm == "none" else r_pg / (1.0 + cfg.seq_eps)
    # Shift by the group's largest reward before averaging: a group of identical rewards then
    # centers to exact zeros. Without it the float32 mean can miss by 1 ulp, and dividing by
    # std + 1e-6 turns that rounding into advantages of ~1e-2. (A max, not r_pg[:, :1]: a slice of
    # a dimension sharded over Explicit mesh axes is refused when groups span devices.)
    shifted = r_pg - r_pg.max(axis=1, keepdims=True)  # [P, G]
    centered = shifted - shifted.mean(axis=1, keepdims=True)  # [P, G]
    if cfg.seq_norm == "none":
        return centered
    var = (centered**2).sum(axis=1, keepdims=True) / (g - cfg.seq_std_ddof)
    return centered / (jnp.sqrt(var) + cfg.seq_eps)


def _discount_matrix(m: int, beta: float) -> np.ndarray:
    """W[k, j] = β^(k−j) for k ≥ j, so R = r @ W gives R^j = Σ_{k≥j} β^(k−j) r^k."""
    k = np.arange(m)
    expo = k[:, None] - k[None, :]  # [M, M]
    return np.where(expo >= 0, float(beta) ** np.maximum(expo, 0), 0.0).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("group_size", "cfg"))
def rbat_advantages(
    acc: jax.Array,
    fmt_ok: jax.Array,
    turn_is_tool: jax.Array,
    turn_failed: jax.Array,
    *,
    group_size: int,
    cfg: RBATConfig,
    turn_valid: jax.Array | None = None,
    resp_len: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sequence and turn advantages of a global batch (SPEC §4 kernel contract).

    acc: float32[B] in {0, 1}; fmt_ok: bool[B]; turn_is_tool, turn_failed: bool[B, M]. B = P·G with
    the G trajectories of a prompt contiguous. Returns a_seq: float32[B] and a_turn: float32[B, M]
    (already weighted by w_turn, 0 on non-tool turns; with `turn_stats="all"` on every turn taken).
    Optional inputs, needed only by switches that are off by default: turn_valid bool[B, M], the
    turns each trajectory took (`turn_stats="all"`); resp_len float32[B], sampled tokens per
    trajectory (`overlong_cache > 0`).
    """
    b = turn_is_tool.shape[0]
    if b % group_size:
        raise ValueError(f"batch of {b} trajectories is not a whole number of groups of {group_size}")
    turn_valid, resp_len = _optional_inputs(acc, turn_is_tool, turn_valid, resp_len, cfg)
    body = functools.partial(_rbat_body, group_size=group_size, cfg=cfg)
    seq_sharding, turn_sharding = jax.typeof(acc).sharding, jax.typeof(turn_is_tool).sharding
    if any(t == AxisType.Explicit for t in seq_sharding.mesh.axis_types):
        # Under Explicit mesh axes (the default of `jax.make_mesh`) the [B] → [P, G] reshapes are
        # refused when a group spans devices; the kernel is a handful of tiny reductions, so let
        # the compiler place them (Auto axes) and hand back the inputs' batch sharding.
        body = jax.sharding.auto_axes(body, out_sharding=(seq_sharding, turn_sharding))
    return body(acc, fmt_ok, turn_is_tool, turn_failed, turn_valid, resp_len)


def _optional_inputs(acc, turn_is_tool, turn_valid, resp_len, cfg: RBATConfig):
    """turn_valid and resp_len, required by the switches that read them, else stand-ins derived
    from the inputs (so they keep the batch sharding)."""
    if turn_valid is None:
        if cfg.turn_stats == "all":
            raise ValueError("RBATConfig.turn_stats='all' needs turn_valid (bool[B, M], the turns each trajectory "
                             "took; scoring.score returns it)")
        turn_valid = turn_is_tool
    if resp_len is None:
        if cfg.overlong_cache > 0:
            raise ValueError("RBATConfig.overlong_cache > 0 needs resp_len (float32[B], sampled tokens per trajectory)")
        resp_len = acc * 0.0
    return turn_valid, resp_len


def overlong_penalty(resp_len: jax.Array, l_max: int, l_cache: int) -> jax.Array:
    """DAPO's soft overlong punishment (eq. 13): 0 up to L_max − L_cache tokens, then linear down to
    −1 at L_max, −1 beyond. resp_len: [B] → float32[B]."""
    n = resp_len.astype(jnp.float32)
    return jnp.clip(((l_max - l_cache) - n) / l_cache, -1.0, 0.0)


def _sequence_rewards(acc, fmt_ok, turn_is_tool, turn_failed, resp_len, *, group_size: int, cfg: RBATConfig) -> dict:
    """Per-trajectory reward parts [B]: r_acc, r_format, r_seq (R_BAT sequence term, or the
    DeepEyes-style bonus in mode "tool_bonus"), r_length (DAPO overlong shaping, only when on) and
    their sum `total` (what A_seq normalizes)."""
    b, _ = turn_is_tool.shape
    acc = acc.astype(jnp.float32)  # [B]
    correct = acc > 0
    fmt_ok = fmt_ok.astype(bool)  # [B]
    is_tool = turn_is_tool.astype(bool)  # [B, M]
    # A failure flag on a non-tool (answer or padding) turn is meaningless: nothing was executed.
    failed = turn_failed.astype(bool) & is_tool  # [B, M]

    # --- outcome reward ---
    if cfg.format_style == "bonus":
        r_format = cfg.w_format * fmt_ok.astype(jnp.float32)
    else:
        r_format = -cfg.w_format * (~fmt_ok).astype(jnp.float32)
    score = cfg.w_acc * acc + r_format  # [B]

    n_total = is_tool.sum(axis=1).astype(jnp.float32)  # [B]
    n_succ = (is_tool & ~failed).sum(axis=1).astype(jnp.float32)  # [B]
    # N_succ/N_total, with R_seq = 0 when no tool was called ([decided]; release: 0 without calls).
    succ_ratio = jnp.where(n_total > 0, n_succ / jnp.maximum(n_total, 1.0), 0.0)  # [B]

    r_seq = acc * 0.0  # derived from an input so it keeps the batch sharding
    if cfg.mode == "tool_bonus":
        r_seq = cfg.w_tool_bonus * (correct & (n_succ > 0)).astype(jnp.float32)
    elif cfg.mode in ("no_turn", "full"):
        mu_src = correct.astype(jnp.float32) if cfg.mu_acc_source == "accuracy" else score
        mu_acc = mu_src.reshape(-1, group_size).mean(axis=1, keepdims=True)  # [P, 1]
        z = cfg.gamma * (0.5 - mu_acc)
        base = jax.nn.sigmoid(z) if cfg.difficulty == "sigmoid" else (1.0 + jnp.tanh(z)) / 2.0
        # Broadcast d over the group in [P, G] layout (no jnp.repeat: it needs an explicit
        # out_sharding under a mesh with Explicit axes).
        c = jnp.where(correct, cfg.tool_weight_correct, cfg.tool_weight_wrong)  # [B]
        d = base - cfg.delta  # [P, 1]
        if cfg.mastered == "direct":
            direct = (~is_tool.any(axis=1)).reshape(-1, group_size)  # [P, G]
            wrong_direct = (direct & ~correct.reshape(-1, group_size)).sum(axis=1, keepdims=True)
            redundant = (direct.sum(axis=1, keepdims=True) > 0) & (wrong_direct == 0)  # [P, 1]
            d = jnp.where(redundant, d, jnp.maximum(d, 0.0))
        r_seq = ((c * succ_ratio).reshape(-1, group_size) * d).reshape(b)  # [P, G] -> [B]
    parts = {"r_acc": cfg.w_acc * acc, "r_format": r_format, "r_seq": r_seq, "total": score + r_seq}
    if cfg.overlong_cache > 0:
        parts["r_length"] = overlong_penalty(resp_len, cfg.overlong_max, cfg.overlong_cache)
        parts["total"] = parts["total"] + parts["r_length"]
    return parts


@functools.partial(jax.jit, static_argnames=("group_size", "cfg"))
def rbat_rewards(acc, fmt_ok, turn_is_tool, turn_failed, *, group_size: int, cfg: RBATConfig, resp_len=None) -> dict:
    """The reward parts behind `rbat_advantages` (for logging and reports), float32[B] each."""
    _, resp_len = _optional_inputs(acc, turn_is_tool, turn_is_tool, resp_len, cfg)
    return _sequence_rewards(acc, fmt_ok, turn_is_tool, turn_failed, resp_len, group_size=group_size, cfg=cfg)


def _rbat_body(acc, fmt_ok, turn_is_tool, turn_failed, turn_valid, resp_len, *, group_size: int, cfg: RBATConfig):
    b, m = turn_is_tool.shape
    is_tool = turn_is_tool.astype(bool)  # [B, M]
    failed = turn_failed.astype(bool) & is_tool  # [B, M]
    r = _sequence_rewards(acc, fmt_ok, turn_is_tool, turn_failed, resp_len, group_size=group_size, cfg=cfg)["total"]

    a_seq = _group_normalize(r.reshape(-1, group_size), cfg).reshape(b)  # [B]

    if cfg.mode != "full":
        # Derived from an input rather than jnp.zeros, so it keeps the batch sharding.
        return a_seq, is_tool.astype(jnp.float32) * 0.0

    # --- turn level ---
    r_turn = jnp.where(failed, cfg.fail_penalty, 0.0).astype(jnp.float32)  # [B, M]
    returns = jnp.einsum("bk,kj->bj", r_turn, jnp.asarray(_discount_matrix(m, cfg.beta)))  # [B, M]
    # The turns with statistics and an advantage: tool turns (default), or every turn taken.
    sel = is_tool if cfg.turn_stats == "tool" else (turn_valid.astype(bool) | is_tool)  # [B, M]
    w = sel.astype(jnp.float32)  # [B, M]
    if cfg.turn_baseline == "turn_loo":
        return a_seq, cfg.w_turn * _turn_loo(returns, w, cfg) * w
    count = jnp.maximum(w.sum(), 1.0)
    # Same exact-zero shift as in _group_normalize, by the largest selected return of the batch.
    shift = jnp.max(jnp.where(sel, returns, -jnp.inf))
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    shifted = returns - shift  # [B, M]
    centered = shifted - (shifted * w).sum() / count  # [B, M]
    sigma = jnp.sqrt(((centered * w) ** 2).sum() / count)
    if cfg.turn_norm == "eps":
        a_turn = centered / (sigma + cfg.turn_eps)
    else:
        a_turn = jnp.where(sigma > cfg.turn_std_floor, centered / jnp.maximum(sigma, cfg.turn_std_floor), returns)
    return a_seq, cfg.w_turn * a_turn * w


def _turn_loo(returns: jax.Array, w: jax.Array, cfg: RBATConfig) -> jax.Array:
    """(R^m_i − μ^m_{-i}) / σ_{-i}: μ^m_{-i} the mean of turn m's returns over the *other*
    trajectories' selected turns m (w = 1), σ_{-i} the population std of the other trajectories'
    selected returns over all turn indices. Nothing of trajectory i enters its own baseline or scale,
    and the scale is one distribution for every trajectory and turn of an i.i.d. batch, so
    E[Σ_m ∇log π(a^m_i) Â^m_i] = E[1/σ_{-i}]·E[Σ_m ∇log π(a^m_i) R^m_i]: the baseline-free turn-level
    gradient, rescaled as a whole. (A σ per turn index would rescale each turn's share differently:
    benchmarks/results/rturn_bias/.)"""
    # Shift by the largest selected return: equal returns become exact zeros, so a zero spread of
    # the others sums to exactly 0 below (as in _group_normalize).
    shift = jnp.max(jnp.where(w > 0, returns, -jnp.inf))
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    x = (returns - shift) * w  # [B, M]
    n_o = w.sum(axis=0, keepdims=True) - w  # [B, M] other trajectories at this turn index
    mean_o = jnp.where(n_o > 0, (x.sum(axis=0, keepdims=True) - x) / jnp.maximum(n_o, 1.0), -shift)  # none: 0
    # The scale: the other trajectories' selected turns, all turn indices.
    n_all = w.sum() - w.sum(axis=1, keepdims=True)  # [B, 1]
    s1 = x.sum() - x.sum(axis=1, keepdims=True)  # [B, 1]
    s2 = (x**2).sum() - (x**2).sum(axis=1, keepdims=True)
    m_all = s1 / jnp.maximum(n_all, 1.0)
    sd_o = jnp.sqrt(jnp.maximum(s2 / jnp.maximum(n_all, 1.0) - m_all**2, 0.0))  # [B, 1]
    centered = x - mean_o  # [B, M]
    tol = max(cfg.turn_std_floor, 1e-3 * abs(cfg.fail_penalty))
    scaled = (n_all >= 2) & (sd_o > tol)  # [B, 1]
    d = sd_o + cfg.turn_eps if cfg.turn_norm == "eps" else sd_o
    return jnp.where(scaled, centered / jnp.where(scaled, d, 1.0), centered)


register_advantage("rbat")(rbat_advantages)
