"""The jit sampler: N decode steps over the static KV cache per call, batched, with stops and budgets.

One call of `decode_chunk` runs a `lax.while_loop` of up to `steps` one-token `extend` steps and
returns to the host, which then checks stops on text, runs code and appends observations. Rows
that are not `active` (finished, or waiting for the sandbox) sit out every step with mask 0. The
loop exits early when no row is active.

Sampling (per row, per step), as verl/vLLM do it:
  z = logits / temperature (float32);
  logprob of the chosen token = log_softmax(z) over the FULL vocabulary, before the vocabulary mask
    and before top-k/top-p truncation (SPEC: what one full forward of the policy recomputes);
  ids >= the tokenizer's size are masked out (the embedding has more rows than the tokenizer);
  top-k, then top-p (smallest prefix of the sorted distribution whose mass reaches p; the token
    that crosses p is kept), then a categorical draw (inverse CDF, `categorical`); greedy mode
    takes the argmax instead.
Randomness is per row and per token: the key of row b's n-th sampled token is
fold_in(fold_in(seed_key, uid[b]), n), so a trajectory's draws do not depend on which other rows
were active at the same step (with overlap that changes with sandbox timing).

Stops on device. A stop string ends a row inside the loop when the last tokens are one of its
precomputed token-id forms (`StopTable`): a canonical tokenization of a suffix of the string,
preceded by a token whose text ends with the rest of the string (Qwen's BPE writes `</code>` as
`</`,`code`,`>` but also ` </`,`code`,`>`). Forms where the stop string ends inside a longer token
(`>\\n`) are not listed: the host checks the decoded text after every chunk and rolls back the
tokens sampled past the stop (see `engine.py`). Budgets are a per-row count of tokens still
allowed (`limit`), the minimum of the per-turn and per-trajectory budgets.

Scripted policies force tokens through the same path: `forced[b, j] >= 0` replaces the j-th token
row b emits in this chunk (its log-prob is still the policy's), which the tests use to write code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from codedance_jax.model.generate import decode_step
from codedance_jax.model.qwen25vl import KVCache


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature τ (logprobs are log_softmax(logits / τ)); top_p ∈ (0, 1]; top_k = 0 is off.

    greedy: argmax (evaluation); logprobs still use `temperature`. seed: the base of every key.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


# ----------------------------------------------------------------------------- stop strings


@dataclasses.dataclass(frozen=True)
class StopTable:
    """Token-id forms of the stop strings, for the device check.

    E forms, K = longest tail. tail int32[E, K]: the form's last tokens, right-aligned, -1 padding.
    head_col int32[E]: column in the [B, K + 1] history of the token before the tail.
    head_ok bool[E, V]: which tokens may stand there (their text ends with the rest of the string);
    all True for forms whose tail is the whole string.
    """

    strings: tuple[str, ...]
    tail: np.ndarray
    head_col: np.ndarray
    head_ok: np.ndarray
    has_head: np.ndarray  # bool[E]

    @property
    def history(self) -> int:
        return self.tail.shape[1] + 1


def _token_texts(tokenizer, vocab: int) -> list[str]:
    return tokenizer.backend.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)


def build_stop_table(tokenizer, strings: Sequence[str], vocab_size: int) -> StopTable:
    """Token forms of each stop string (see the module docstring). `vocab_size`: the model's V."""
    n_tok = len(tokenizer)
    texts = None
    forms: list[tuple[list[int], str]] = []  # (tail ids, head text)
    for s in strings:
        for cut in range(len(s)):
            head, rest = s[:cut], s[cut:]
            ids = tokenizer.encode(rest)
            if tokenizer.decode(ids) != rest:
                continue
            if (ids, head) not in forms:
                forms.append((ids, head))
    k = max(len(ids) for ids, _ in forms)
    tail = np.full((len(forms), k), -1, np.int32)
    head_col = np.zeros((len(forms),), np.int32)
    head_ok = np.ones((len(forms), vocab_size), bool)
    for e, (ids, head) in enumerate(forms):
        tail[e, k - len(ids) :] = ids
        head_col[e] = k - len(ids)
        if head:
            if texts is None:
                texts = _token_texts(tokenizer, n_tok)
            head_ok[e] = False
            head_ok[e, :n_tok] = [t.endswith(head) for t in texts]
    has_head = np.array([bool(head) for _, head in forms])
    return StopTable(tuple(strings), tail, head_col, head_ok, has_head)


def stop_hit(hist_bk, tail_ek, head_col_e, head_ok_ev, has_head_e):
    """bool[B]: the history int32[B, K + 1] (latest token last, -1 before the turn) ends in a stop form."""
    tail_match = jnp.all((tail_ek[None] < 0) | (hist_bk[:, None, 1:] == tail_ek[None]), axis=-1)  # [B, E]
    head_tok = hist_bk[:, head_col_e]  # [B, E]
    e = jnp.arange(tail_ek.shape[0])[None, :]
    ok = head_ok_ev[e, jnp.maximum(head_tok, 0)] & (head_tok >= 0)
    return jnp.any(tail_match & (ok | ~has_head_e[None, :]), axis=-1)


# ----------------------------------------------------------------------------------- sampling


_BLOCK = 1024  # inverse-CDF sampling runs over blocks of the vocabulary (see `categorical`)


def categorical(keys, probs_bv):
    """One draw per row from unnormalized probabilities [B, V] by inverse CDF, two levels deep.

    A cumulative sum over the whole 152k vocabulary in float32 would lose precision in the tail,
    and Gumbel-max needs V random numbers per row and step (most of a tiny model's step time on
    CPU); here one uniform per row picks a block of 1024 ids by the blocks' masses, then an id
    inside the block. Ids with probability 0 are never returned.
    """
    b, v = probs_bv.shape
    nb = -(-v // _BLOCK)
    p = jnp.pad(probs_bv, ((0, 0), (0, nb * _BLOCK - v))).reshape(b, nb, _BLOCK)
    mass = jnp.sum(p, axis=-1)  # [B, nb]
    cum = jnp.cumsum(mass, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * cum[:, -1]
    last_blk = jnp.max(jnp.where(mass > 0, jnp.arange(nb)[None], 0), axis=-1)
    blk = jnp.minimum(jnp.sum(cum <= u[:, None], axis=-1), last_blk)  # [B]
    u2 = u - (jnp.take_along_axis(cum, blk[:, None], 1)[:, 0] - jnp.take_along_axis(mass, blk[:, None], 1)[:, 0])
    inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
    last_id = jnp.max(jnp.where(inner > 0, jnp.arange(_BLOCK)[None], 0), axis=-1)
    idx = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= u2[:, None], axis=-1), last_id)
    return (blk * _BLOCK + idx).astype(jnp.int32)


def sample(logits_bv, keys, temperature, top_p, *, vocab_limit: int, top_k: int, use_top_p: bool, greedy: bool,
           banned: tuple[int, ...] = ()):
    """Returns (tokens int32[B], z = logits / temperature float32[B, V], logsumexp(z) float32[B]).

    The log-prob of any token t (sampled or forced) is z[t] - lse: before the vocabulary mask and
    before truncation.
    """
    z = logits_bv.astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    v = z.shape[-1]
    ids = jnp.arange(v)[None, :]
    allowed = ids < vocab_limit
    for t in banned:  # tokens only the host may write (vision placeholders): a policy never samples them
        allowed = allowed & (ids != t)
    zm = jnp.where(allowed, z, -jnp.inf)
    if greedy:  # the first maximal id (as argmax), written as two plain reductions: faster on CPU
        best = jnp.max(zm, axis=-1, keepdims=True)
        tok = jnp.min(jnp.where(zm == best, jnp.arange(v)[None, :], v), axis=-1)
        return tok.astype(jnp.int32), z, lse
    if top_k:
        kth = jax.lax.top_k(zm, top_k)[0][:, -1:]
        zm = jnp.where(zm >= kth, zm, -jnp.inf)
    if use_top_p:
        srt = jax.lax.top_k(zm, top_k)[0] if top_k else -jnp.sort(-zm, axis=-1)  # [B, V'] descending
        p = jax.nn.softmax(srt, axis=-1)
        keep = (jnp.cumsum(p, axis=-1) - p) < top_p  # mass before this token is below p
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        zm = jnp.where(zm >= thresh, zm, -jnp.inf)
    probs = jnp.exp(zm - jnp.max(zm, axis=-1, keepdims=True))
    return categorical(keys, probs), z, lse


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "steps", "vocab_limit", "top_k", "use_top_p", "greedy", "banned"),
    donate_argnames=("cache",),
)
def _decode_chunk(
    state,
    cache: KVCache,
    logits,
    active,
    limit,
    hist,
    forced,
    uid,
    count,
    temperature,
    top_p,
    base_key,
    tail,
    head_col,
    head_ok,
    has_head,
    *,
    graphdef,
    steps: int,
    vocab_limit: int,
    top_k: int,
    use_top_p: bool,
    greedy: bool,
    banned: tuple[int, ...] = (),
    row_greedy=None,
):
    model = nnx.merge(graphdef, state)
    b = logits.shape[0]
    rows = jnp.arange(b)

    def cond(c):
        return (c["i"] < steps) & jnp.any(c["active"])

    def body(c):
        act = c["active"]
        keys = jax.vmap(lambda u, n: jax.random.fold_in(jax.random.fold_in(base_key, u), n))(uid, c["count"])
        tok, z, lse = sample(
            c["logits"],
            keys,
            temperature,
            top_p,
            vocab_limit=vocab_limit,
            top_k=top_k,
            use_top_p=use_top_p,
            greedy=greedy,
            banned=banned,
        )
        if row_greedy is not None:  # per-row settings mixing sampled and greedy rows (the server's batches)
            best, _, _ = sample(c["logits"], keys, temperature, top_p, vocab_limit=vocab_limit, top_k=0,
                                use_top_p=False, greedy=True, banned=banned)
            tok = jnp.where(row_greedy, best, tok)
        f = forced[rows, jnp.minimum(c["n"], steps - 1)]
        tok = jnp.where(act, jnp.where(f >= 0, f, tok), 0)
        lp = jnp.where(act, jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - lse, 0.0)
        hist = jnp.where(act[:, None], jnp.concatenate([c["hist"][:, 1:], tok[:, None]], axis=1), c["hist"])
        hit = act & stop_hit(hist, tail, head_col, head_ok, has_head)
        lim = c["limit"] - act.astype(jnp.int32)
        new_logits, new_cache = decode_step(model, c["cache"], tok, act)
        i = c["i"]
        return dict(
            i=i + 1,
            cache=new_cache,
            logits=jnp.where(act[:, None], new_logits, c["logits"]),
            active=act & ~hit & (lim > 0),
            limit=lim,
            hist=hist,
            count=c["count"] + act,
            n=c["n"] + act,
            stopped=c["stopped"] | hit,
            tokens=c["tokens"].at[:, i].set(tok),
            logprobs=c["logprobs"].at[:, i].set(lp),
            emitted=c["emitted"].at[:, i].set(act),
        )

    init = dict(
        i=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=logits,
        active=active & (limit > 0),
        limit=limit,
        hist=hist,
        count=count,
        n=jnp.zeros((b,), jnp.int32),
        stopped=jnp.zeros((b,), bool),
        tokens=jnp.zeros((b, steps), jnp.int32),
        logprobs=jnp.zeros((b, steps), jnp.float32),
        emitted=jnp.zeros((b, steps), bool),
    )
    out = jax.lax.while_loop(cond, body, init)
    return out


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings (numpy [B]): temperature > 0 (log-probs use it), top_p in (0, 1], greedy."""

    temperature: np.ndarray
    top_p: np.ndarray
    greedy: np.ndarray


@dataclasses.dataclass
class ChunkOut:
    """Host copies of one decode chunk. Step i of the chunk wrote cache slot `start + i`."""

    tokens: np.ndarray  # int32[B, N]
    logprobs: np.ndarray  # float32[B, N]
    emitted: np.ndarray  # bool[B, N]
    stopped: np.ndarray  # bool[B]: ended on a stop form
    active: np.ndarray  # bool[B]: still running at the end of the chunk
    limit: np.ndarray  # int32[B]: budget left
    steps: int  # steps run (< N when every row stopped early)
    start: int  # cache slot of step 0

    def expand(self, rows_n: np.ndarray, batch: int) -> ChunkOut:
        """The chunk of a row subset (rows_n int[n] of a batch of `batch`) as a whole-batch chunk."""

        def put(x):
            full = np.zeros((batch, *x.shape[1:]), x.dtype)
            full[rows_n] = x
            return full

        return ChunkOut(put(self.tokens), put(self.logprobs), put(self.emitted), put(self.stopped), put(self.active),
                        put(self.limit), self.steps, self.start)


class Sampler:
    """Holds the split model, the stop table on device and the sampling settings."""

    def __init__(self, model, stops: StopTable, cfg: SamplingConfig, vocab_limit: int, steps: int,
                 banned: tuple[int, ...] = ()):
        self.graphdef, self.state = nnx.split(model)
        self.banned = tuple(sorted(int(t) for t in banned))
        self.cfg = cfg
        self.steps = steps
        self.vocab_limit = vocab_limit
        self.stops = stops
        self._tables = tuple(jnp.asarray(a) for a in (stops.tail, stops.head_col, stops.head_ok, stops.has_head))
        self._key = jax.random.key(cfg.seed)

    def chunk_call(self, cache: KVCache, logits, active, limit, hist, forced, uid, count,
                   rows: RowSampling | None = None):
        """(jitted function, positional args, static kwargs) of one decode chunk on device arrays.

        `decode_chunk` calls exactly this; the pod preflight lowers it on abstract arguments
        (`fn.lower(*args, **kwargs)`) to compile the engine's decode step for a TPU slice."""
        cfg = self.cfg
        temperature, top_p, use_top_p, greedy, row_greedy = (
            jnp.float32(cfg.temperature), jnp.float32(cfg.top_p), cfg.top_p < 1.0, cfg.greedy, None)
        if rows is not None:
            temperature = jnp.asarray(rows.temperature, jnp.float32)[:, None]
            # top_p = 1 must keep every token: float32 cumulative mass can reach 1 before the tail.
            top_p = jnp.asarray(np.where(np.asarray(rows.top_p) >= 1.0, 2.0, rows.top_p), jnp.float32)[:, None]
            greedy = bool(np.all(rows.greedy))
            use_top_p = not greedy and bool(np.any(np.asarray(rows.top_p) < 1.0))
            row_greedy = None if greedy else jnp.asarray(rows.greedy, bool)
        args = (self.state, cache, logits, active, limit, hist, forced, uid, count, temperature, top_p, self._key,
                *self._tables)
        kwargs = dict(graphdef=self.graphdef, steps=self.steps, vocab_limit=self.vocab_limit, top_k=cfg.top_k,
                      use_top_p=use_top_p, greedy=greedy, banned=self.banned, row_greedy=row_greedy)
        return _decode_chunk, args, kwargs

    def decode_chunk(self, cache: KVCache, logits, active, limit, hist, forced, uid, count, start: int | None = None,
                     rows: RowSampling | None = None):
        """Runs up to `steps` steps; host inputs are numpy [B] / [B, K+1] / [B, N]. Returns (ChunkOut, cache, logits).

        start: the cache's write index when the caller tracks it on the host (saves a device sync).
        `rows`: per-row temperature, top-p and greedy flags instead of the config's (one compile for
        all-greedy batches, one for mixed ones); top-k stays the config's."""
        start = int(cache.index) if start is None else start
        fn, args, kwargs = self.chunk_call(cache, logits, jnp.asarray(active, bool), jnp.asarray(limit, jnp.int32),
                                           jnp.asarray(hist, jnp.int32), jnp.asarray(forced, jnp.int32),
                                           jnp.asarray(uid, jnp.int32), jnp.asarray(count, jnp.int32), rows)
        out = fn(*args, **kwargs)
        host = jax.device_get({k: out[k] for k in ("tokens", "logprobs", "emitted", "stopped", "active", "limit", "i")})
        chunk = ChunkOut(
            host["tokens"],
            host["logprobs"],
            host["emitted"],
            host["stopped"],
            host["active"],
            host["limit"],
            int(host["i"]),
            start,
        )
        return chunk, out["cache"], out["logits"]
