"""Synthetic CTR data with realistic distributions and a fixed random "teacher".

What a row looks like (all per-feature parameters are drawn once from ``teacher_seed``, so
they are the same world for train and eval and for every run):

- sparse feature f: a Zipf(``zipf_exponent``) rank over ``cardinalities[f]`` ids, sampled by
  inverse CDF (``torch.searchsorted`` on a precomputed float64 CDF of the 131,072 hottest
  ranks; rarer ranks of huge features from the continuous power-law tail, so memory stays
  bounded), then mapped through a fixed random permutation (an affine bijection above 2^20
  ids) so that hot ids are scattered over the table as hashed ids are;
- dense feature j: a heavy-tailed count (log-normal for two features in three, Pareto for
  the third), zero-inflated with a per-feature zero probability, passed through
  ``log(1 + x)``; each value is independently missing with probability ``missing_rate``,
  and missing reads as 0 (as in the Criteo convention);
- label: Bernoulli(sigmoid(logit)), where the teacher's logit is a sum of four terms, each
  normalized on a calibration sample: a first-order weight per (feature, id), pairwise
  factorization-machine interactions (dot products of small per-id embeddings, and of
  dense values times per-feature embeddings; ranks past 131,072 share teacher rows), a
  dense linear term and a small tanh MLP of
  the dense features. A bias, found once by bisection on the calibration sample, makes the
  mean click probability equal ``base_rate``. With the default ``teacher_logit_std=1.5`` the
  teacher itself reaches a normalized entropy (NE) of about 0.74, near the ~0.78 of good
  models on Criteo: there is real signal to learn, and a ceiling a short run cannot pass.

Behaviour sequences (``seq_len`` > 0; off by default, so existing streams are unchanged):
each row gets the user's recent events as ids of sparse feature 0 (the target item's id space),
at most ``seq_len`` of them, oldest to newest, left-padded with a mask (see
:class:`~loka_tune.data.base.Batch`). Lengths are heavy-tailed as user activity is: 5% of
users have no events (cold start), the rest a log-normal count (median ``seq_len / 4``, sigma 1)
capped at ``seq_len``, so a pile-up sits at the cap as in truncated real logs. Each event is
the target item itself with probability 0.15 (users revisit what they like) and otherwise a
Zipf draw from feature 0's popularity. The teacher gains a fifth logit term: the dot product
of the target item's teacher embedding with the mean teacher embedding of the user's events
(zero for a cold user), so the click depends on the sequence's content and a model that reads
the sequence can do better than one that cannot.

Streams: train rows come from a ``torch.Generator`` on the target device seeded from
``(seed, "train")``, so a GPU run generates its own data without host work; the same seed
on the same device type gives identical batches (CPU and CUDA generators produce different
streams). Eval rows are ``eval_examples`` rows drawn once, on the CPU, from a stream seeded by
``(teacher_seed, "eval")``: the same eval set for every ``seed``, batch size and device, and
disjoint from every train stream (a different generator stream).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .base import Batch
from .hashing import mix_seed

__all__ = ["SyntheticCTR", "synthetic_for", "DEFAULT_CARDINALITIES"]

# Criteo Kaggle's 26 categorical cardinalities, capped at 100k so that default embedding
# tables stay small enough for CPU tests (1.05M ids in all).
DEFAULT_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 100_000, 100_000, 305, 24, 12517, 633, 3, 93145, 5683, 100_000, 3194,
    27, 14992, 100_000, 10, 5652, 2173, 4, 100_000, 18, 15, 100_000, 105, 100_000,
)  # fmt: skip

_EXACT_RANKS = 1 << 17  # Zipf ranks sampled from an exact CDF table; rarer ones: continuous tail
_PERM_TABLE_MAX = 1 << 20  # features up to this size get a random rank -> id table; larger: affine
_TEACHER_ROWS = 1 << 17  # teacher rows per feature; rarer ranks share rows (rank % rows)
_MAX_CARDINALITY = 1 << 31  # keeps the affine map's int64 arithmetic exact
_CALIBRATION_ROWS = 1 << 16  # rows used to normalize teacher terms and fit the bias
_MEASURE_ROWS = 1 << 16  # independent rows used to measure `base_rate`
_TEACHER_HIDDEN = 8  # width of the teacher's small dense MLP
# relative std of the teacher's terms: first-order, pairwise (FM), dense linear, dense MLP
_TERM_WEIGHTS = (0.6, 1.0, 0.4, 0.4)
_SEQ_TERM_WEIGHT = 1.0  # relative std of the fifth term (user sequence x target item), when on
_SEQ_COLD = 0.05  # share of users with no events
_SEQ_MEDIAN_FRAC = 0.25  # median length / seq_len of the other users (log-normal)
_SEQ_SIGMA = 1.0  # log-normal sigma of the lengths: heavy-tailed user activity
_SEQ_REPEAT = 0.15  # probability that an event is the target item itself
_MAX_SEQ_LEN = 4096  # a bound that keeps the (rows x seq_len) draws in memory


class SyntheticCTR:
    """A deterministic, streaming synthetic CTR source (see the module docstring).

    ``batches(split, batch_size, seed, device)``: ``"train"`` is infinite, generated on
    ``device``; ``"eval"`` is ``eval_examples`` rows in batches of ``batch_size`` (last one
    shorter when it does not divide). ``base_rate`` is the measured mean click probability
    on an independent sample; ``target_base_rate`` is what was asked for.
    """

    def __init__(
        self,
        num_dense: int = 13,
        cardinalities: Sequence[int] = DEFAULT_CARDINALITIES,
        base_rate: float = 0.2,
        zipf_exponent: float = 1.1,
        missing_rate: float = 0.1,
        teacher_seed: int = 1234,
        eval_examples: int = 16384,
        name: str = "synthetic",
        teacher_dim: int = 4,
        teacher_logit_std: float = 1.5,
        seq_len: int = 0,
    ) -> None:
        if isinstance(cardinalities, int):
            cardinalities = (cardinalities,)
        try:
            cardinalities = tuple(int(c) for c in cardinalities)
        except (TypeError, ValueError):
            raise ConfigError(
                f"must be a list of ints, one per sparse feature, got {cardinalities!r}",
                key="cardinalities",
            ) from None
        _check(num_dense >= 0, "num_dense", f"must be >= 0, got {num_dense=}")
        _check(len(cardinalities) >= 1, "cardinalities", "needs at least one sparse feature")
        _check(
            all(1 <= c <= _MAX_CARDINALITY for c in cardinalities),
            "cardinalities",
            f"every cardinality must be in [1, 2**31], got {cardinalities}",
        )
        _check(0.0 < base_rate < 1.0, "base_rate", f"must be in (0, 1), got {base_rate=}")
        _check(zipf_exponent >= 0.0, "zipf_exponent", f"must be >= 0 (0 = uniform), got {zipf_exponent=}")
        _check(0.0 <= missing_rate < 1.0, "missing_rate", f"must be in [0, 1), got {missing_rate=}")
        _check(eval_examples >= 1, "eval_examples", f"must be >= 1, got {eval_examples=}")
        _check(teacher_dim >= 1, "teacher_dim", f"must be >= 1, got {teacher_dim=}")
        _check(teacher_logit_std >= 0.0, "teacher_logit_std", f"must be >= 0, got {teacher_logit_std=}")
        _check(
            isinstance(seq_len, int) and not isinstance(seq_len, bool) and 0 <= seq_len <= _MAX_SEQ_LEN,
            "seq_len",
            f"must be an int in [0, {_MAX_SEQ_LEN}] (0: no behaviour sequences), got {seq_len=!r}",
        )

        self.name = name
        self.num_dense = int(num_dense)
        self.cardinalities = cardinalities
        self.target_base_rate = float(base_rate)
        self.zipf_exponent = float(zipf_exponent)
        self.missing_rate = float(missing_rate)
        self.teacher_seed = int(teacher_seed)
        self.eval_examples = int(eval_examples)
        self.seq_len = int(seq_len)
        self.dense_names = tuple(f"I{j + 1}" for j in range(self.num_dense))
        self.sparse_names = tuple(f"C{f + 1}" for f in range(len(cardinalities)))
        self._world = _build_world(
            self.num_dense, cardinalities, self.zipf_exponent, self.teacher_seed, teacher_dim
        )
        self._world["missing_rate"] = torch.tensor(self.missing_rate)
        self._world["seq_len"] = self.seq_len
        _calibrate(self._world, self.teacher_seed, self.target_base_rate, teacher_logit_std)
        self._on_device: dict[str, dict] = {"cpu": self._world}
        self._eval: dict[str, Batch] = {}
        self._base_rate: float | None = None

    # ------------------------------------------------------------------ public API
    @property
    def num_sparse(self) -> int:
        return len(self.cardinalities)

    @property
    def base_rate(self) -> float:
        """Mean click probability measured on an independent CPU sample of 65,536 rows."""
        if self._base_rate is None:
            g = torch.Generator().manual_seed(mix_seed(self.teacher_seed, "measure"))
            p = _rows(self._world, _MEASURE_ROWS, g, "cpu")[3]
            self._base_rate = float(p.mean())
        return self._base_rate

    def batches(
        self,
        split: str,
        batch_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> Iterator[Batch]:
        """Yield batches of ``split`` ("train": infinite, on-device; "eval": finite, fixed)."""
        _check_split_and_batch(split, batch_size)
        dev = torch.device(device)
        if split == "eval":
            return self._eval_batches(batch_size, dev)
        return self._train_batches(batch_size, seed, dev)

    def __repr__(self) -> str:
        return (
            f"SyntheticCTR(name={self.name!r}, num_dense={self.num_dense}, "
            f"num_sparse={self.num_sparse}, base_rate={self.target_base_rate}, "
            f"zipf_exponent={self.zipf_exponent}, missing_rate={self.missing_rate}, "
            f"teacher_seed={self.teacher_seed}, eval_examples={self.eval_examples}"
            + (f", seq_len={self.seq_len})" if self.seq_len else ")")
        )

    # ------------------------------------------------------------------ internals
    def _tables(self, dev: torch.device) -> dict[str, torch.Tensor]:
        key = str(dev)
        if key not in self._on_device:
            self._on_device[key] = {k: _to(v, dev) for k, v in self._world.items()}
        return self._on_device[key]

    def _train_batches(self, batch_size: int, seed: int, dev: torch.device) -> Iterator[Batch]:
        tables = self._tables(dev)
        g = torch.Generator(device=dev).manual_seed(mix_seed(seed, "train"))
        while True:
            dense, sparse, labels, _, seq, mask = _rows_seq(tables, batch_size, g, dev)
            yield Batch(dense, sparse, labels, seq, mask)

    def _eval_batches(self, batch_size: int, dev: torch.device) -> Iterator[Batch]:
        key = str(dev)
        if key not in self._eval:
            if "cpu" not in self._eval:
                g = torch.Generator().manual_seed(mix_seed(self.teacher_seed, "eval"))
                dense, sparse, labels, _, seq, mask = _rows_seq(self._world, self.eval_examples, g, "cpu")
                self._eval["cpu"] = Batch(dense, sparse, labels, seq, mask)
            self._eval[key] = self._eval["cpu"].to(dev)
        ev = self._eval[key]
        for start in range(0, self.eval_examples, batch_size):
            yield ev.rows(start, min(start + batch_size, self.eval_examples))


def synthetic_for(num_sparse: int, cardinality: int, num_dense: int = 13, **kwargs: object) -> SyntheticCTR:
    """A :class:`SyntheticCTR` with ``num_sparse`` features of ``cardinality`` ids each."""
    _check(num_sparse >= 1, "num_sparse", f"must be >= 1, got {num_sparse=}")
    return SyntheticCTR(num_dense=num_dense, cardinalities=(int(cardinality),) * int(num_sparse), **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- helpers
def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, key=key)


def _check_split_and_batch(split: str, batch_size: int) -> None:
    if split not in ("train", "eval"):
        raise ConfigError(f"split must be 'train' or 'eval', got {split=!r}", key="split")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive int, got {batch_size=!r}", key="batch_size")


def _to(t: object, dev: torch.device) -> object:
    if isinstance(t, torch.Tensor):
        return t.to(dev)
    if isinstance(t, list):
        return [_to(x, dev) for x in t]
    return t


@dataclass(frozen=True)
class _Zipf:
    """Sampling plan of one sparse feature: ranks 0..card-1 with mass ~ (rank + 1)^-s.

    Ranks below ``head`` come from an exact CDF table (``searchsorted``); the rest, which only
    exist when ``card > head``, from the continuous power law on [head + 1/2, card + 1/2)
    (the midpoint rule: accurate to well under 1e-3 relative per rank there). Rank -> id is a
    random permutation table, or for huge features the affine map ``(mult * r + add) % card``.
    """

    card: int
    head: int
    head_mass: float  # P(rank < head)
    lo: float  # tail bounds, transformed: lo = a^(1-s), hi = b^(1-s) (log a, log b when s = 1)
    hi: float
    one_minus_s: float
    mult: int
    add: int

    def ranks(self, head_cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r = torch.searchsorted(head_cdf, u, right=True)  # (n,) == head when u is in the tail
        if self.card == self.head:
            return r
        v = ((u - self.head_mass) / (1.0 - self.head_mass)).clamp(0.0, 1.0)
        t = self.lo + v * (self.hi - self.lo)
        x = t.exp() if self.one_minus_s == 0.0 else t.pow(1.0 / self.one_minus_s)  # in [a, b]
        tail = (torch.floor(x + 0.5) - 1.0).clamp(self.head, self.card - 1).long()
        return torch.where(r >= self.head, tail, r)


def _zipf(card: int, s: float, g: torch.Generator) -> tuple[_Zipf, torch.Tensor, torch.Tensor | None]:
    """The plan, the head CDF (float64) and the rank -> id table (None: affine) of a feature."""
    head = min(card, _EXACT_RANKS)
    mass = torch.arange(1, head + 1, dtype=torch.float64).pow(-s)  # (head,) unnormalized
    a, b = head + 0.5, card + 0.5
    oms = 0.0 if abs(1.0 - s) < 1e-9 else 1.0 - s
    if card == head:
        lo = hi = tail_mass = 0.0
    elif oms == 0.0:
        lo, hi = math.log(a), math.log(b)
        tail_mass = hi - lo
    else:
        lo, hi = a**oms, b**oms
        tail_mass = (hi - lo) / oms
    cdf = torch.cumsum(mass, 0) / (float(mass.sum()) + tail_mass)
    head_mass = float(cdf[-1])
    if card == head:
        cdf[-1] = 1.0  # u < 1 always lands inside the table
        head_mass = 1.0
    if card <= _PERM_TABLE_MAX:
        perm, mult, add = torch.randperm(card, generator=g), 1, 0
    else:
        perm, add = None, int(torch.randint(card, (1,), generator=g))
        mult = int(torch.randint(1, card, (1,), generator=g))
        while math.gcd(mult, card) != 1:
            mult = mult % (card - 1) + 1
    return _Zipf(card, head, head_mass, lo, hi, oms, mult, add), cdf, perm


def _build_world(
    num_dense: int, cards: tuple[int, ...], s: float, teacher_seed: int, dim: int
) -> dict[str, Any]:
    """Every fixed table of the synthetic world, on the CPU (see the module docstring)."""
    g = torch.Generator().manual_seed(mix_seed(teacher_seed, "world"))
    plans, cdfs, perms = [], [], []
    for c in cards:
        plan, cdf, perm = _zipf(c, s, g)
        plans.append(plan)
        cdfs.append(cdf)
        perms.append(perm)
    rows = [min(c, _TEACHER_ROWS) for c in cards]
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0)[:-1].tolist()], dtype=torch.int64)
    D, H = num_dense, _TEACHER_HIDDEN
    world: dict[str, Any] = {
        "plans": plans,  # list of _Zipf (python values, no tensors)
        "cdfs": cdfs,  # list of (head_f,) float64
        "perms": perms,  # list of (c_f,) int64 rank -> id, or None (affine map)
        "starts": starts,  # (S,) offset of feature f in the concatenated teacher table
        "packed": _packed_teacher(g, sum(rows), dim),  # (sum rows, k + 2)
        # dense count distributions: log(count) ~ mu + sigma * N(0,1) or mu + Exp(1) / alpha
        "mu": torch.rand(D, generator=g) * 4.0,
        "sigma": 0.8 + torch.rand(D, generator=g) * 1.2,
        "alpha": 1.1 + torch.rand(D, generator=g) * 1.4,
        "pareto": torch.arange(D) % 3 == 2,  # every third dense feature is Pareto
        "zero_frac": 0.02 + torch.rand(D, generator=g) * 0.28,
        "v_dense": torch.randn(D, dim, generator=g) / math.sqrt(dim),  # (D, k)
        "w_lin": torch.randn(D, generator=g),
        "w1": torch.randn(D, H, generator=g) / math.sqrt(max(D, 1)),
        "b1": torch.randn(H, generator=g) * 0.5,
        "w2": torch.randn(H, generator=g) / math.sqrt(H),
    }
    world["v_dense_sq"] = world["v_dense"].square().sum(1)  # (D,)
    return world


def _packed_teacher(g: torch.Generator, total: int, dim: int) -> torch.Tensor:
    """Per teacher row: [embedding (k), first-order weight, squared embedding norm]."""
    emb = torch.randn(total, dim, generator=g) / math.sqrt(dim)  # (rows, k)
    first = torch.randn(total, 1, generator=g)  # (rows, 1)
    return torch.cat([emb, first, emb.square().sum(1, keepdim=True)], 1)


def _sample(t: dict, n: int, g: torch.Generator, dev: torch.device | str):
    """Dense (n, D) float32, sparse ids (n, S) int64 and teacher rows (n, S) int64."""
    S = len(t["cdfs"])
    u = torch.rand((S, n), generator=g, dtype=torch.float64, device=dev)
    # per-feature searches on small CDFs stay in cache: faster than one concatenated search
    ranks = [t["plans"][f].ranks(t["cdfs"][f], u[f]) for f in range(S)]  # (n,) each, 0 = hottest
    ids, trows = [], []
    for f, r in enumerate(ranks):
        plan, perm = t["plans"][f], t["perms"][f]
        ids.append(perm[r] if perm is not None else (r * plan.mult + plan.add) % plan.card)
        trows.append(r if plan.card <= _TEACHER_ROWS else r % _TEACHER_ROWS)  # rare ranks share
    # stack along dim 0 then transpose: much faster than a strided stack along dim 1
    sparse = torch.stack(ids).t().contiguous()  # (n, S)
    rows = (torch.stack(trows) + t["starts"][:, None]).t().contiguous()  # (n, S) teacher rows
    D = t["mu"].shape[0]
    if D:
        u_dense = torch.rand((n, D), generator=g, device=dev)  # float32 is plenty for dense
        z = torch.randn((n, D), generator=g, device=dev)
        e = -torch.log1p(-torch.rand((n, D), generator=g, device=dev))  # Exp(1)
        log_count = t["mu"] + torch.where(t["pareto"], e / t["alpha"], t["sigma"] * z)
        count = torch.floor(torch.exp(log_count.clamp(max=40.0)))  # (n, D) heavy-tailed counts
        m = t["missing_rate"]
        # one uniform decides: missing (u < m), a zero count (next (1 - m) * zero_frac), or count
        zero = u_dense < m + (1.0 - m) * t["zero_frac"]
        dense = torch.where(zero, torch.zeros_like(count), torch.log1p(count))
    else:
        dense = torch.zeros((n, 0), dtype=torch.float32, device=dev)
    return dense, sparse, rows


def _sample_seq(t: dict, n: int, g: torch.Generator, dev: torch.device | str, target: torch.Tensor,
                target_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Behaviour sequences of ``n`` users: ids (n, L) int64, mask (n, L) bool, teacher rows (n, L).

    ``target`` / ``target_row``: each row's feature-0 id and teacher row (what a repeat event is).
    """
    L = t["seq_len"]
    plan, cdf, perm = t["plans"][0], t["cdfs"][0], t["perms"][0]
    cold = torch.rand(n, generator=g, device=dev) < _SEQ_COLD
    z = torch.randn(n, generator=g, device=dev)
    length = torch.exp(math.log(L * _SEQ_MEDIAN_FRAC) + _SEQ_SIGMA * z).ceil().clamp(1, L).long()  # (n,)
    length = torch.where(cold, torch.zeros_like(length), length)
    u = torch.rand(n * L, generator=g, dtype=torch.float64, device=dev)
    r = plan.ranks(cdf, u).view(n, L)  # Zipf ranks of feature 0
    ids = perm[r] if perm is not None else (r * plan.mult + plan.add) % plan.card
    rows = r if plan.card <= _TEACHER_ROWS else r % _TEACHER_ROWS  # feature 0 starts at teacher row 0
    repeat = torch.rand((n, L), generator=g, device=dev) < _SEQ_REPEAT
    ids = torch.where(repeat, target[:, None], ids)
    rows = torch.where(repeat, target_row[:, None], rows)
    mask = torch.arange(L, device=dev)[None, :] >= (L - length)[:, None]  # (n, L) left-padded
    zero = torch.zeros_like(ids)
    return torch.where(mask, ids, zero), mask, torch.where(mask, rows, zero)


def _seq_term(t: dict, rows: torch.Tensor, seq_rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n,): the target item's teacher embedding . the mean embedding of the user's events."""
    k = t["v_dense"].shape[1]
    count = mask.sum(1, keepdim=True).clamp_min(1)  # (n, 1)
    w = mask.float() / count  # (n, L): the mean over real events; padding weighs 0
    hist = F.embedding_bag(seq_rows, t["packed"], mode="sum", per_sample_weights=w)[:, :k]  # (n, k)
    return (hist * t["packed"][rows[:, 0], :k]).sum(1)


def _terms(t: dict, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The teacher's four raw logit terms, (n, 4) float32."""
    k = t["v_dense"].shape[1]
    dn = (dense - t["dense_mean"]) / t["dense_std"]  # (n, D) standardized
    # one fused gather + sum over features of [embedding (k), first-order weight, |embedding|^2]
    bag = F.embedding_bag(rows, t["packed"], mode="sum")  # (n, k + 2)
    first = bag[:, k]  # (n,)
    e_sum = bag[:, :k] + dn @ t["v_dense"]  # (n, k): sum of sparse and dense embeddings
    e_sq = bag[:, k + 1] + dn.square() @ t["v_dense_sq"]  # (n,): sum of their squared norms
    fm = 0.5 * (e_sum.square().sum(1) - e_sq)  # (n,) sum of all pairwise dot products
    lin = dn @ t["w_lin"]  # (n,)
    mlp = torch.tanh(dn @ t["w1"] + t["b1"]) @ t["w2"]  # (n,)
    return torch.stack([first, fm, lin, mlp], 1)


def _all_terms(t: dict, n: int, g: torch.Generator, dev: torch.device | str):
    """Sampled rows and their raw teacher terms: dense, sparse, seq, mask, terms (n, 4 or 5)."""
    dense, sparse, rows = _sample(t, n, g, dev)
    terms = _terms(t, dense, rows)
    if not t["seq_len"]:
        return dense, sparse, None, None, terms
    seq, mask, seq_rows = _sample_seq(t, n, g, dev, sparse[:, 0], rows[:, 0])
    terms = torch.cat([terms, _seq_term(t, rows, seq_rows, mask)[:, None]], 1)
    return dense, sparse, seq, mask, terms


def _rows(t: dict, n: int, g: torch.Generator, dev: torch.device | str):
    """``n`` labelled rows: dense, sparse, labels (float32 0/1) and click probabilities."""
    return _rows_seq(t, n, g, dev)[:4]


def _rows_seq(t: dict, n: int, g: torch.Generator, dev: torch.device | str):
    """:func:`_rows`, then the behaviour sequences and their mask (``None`` without sequences)."""
    dense, sparse, seq, mask, terms = _all_terms(t, n, g, dev)
    logit = terms @ t["term_scale"] + t["bias"]  # (n,)
    p = torch.sigmoid(logit)
    labels = (torch.rand(n, generator=g, device=dev) < p).float()
    return dense, sparse, labels, p, seq, mask


def _calibrate(t: dict, teacher_seed: int, base_rate: float, logit_std: float) -> None:
    """Fit dense standardization, term scales and the bias on a fixed CPU sample."""
    g = torch.Generator().manual_seed(mix_seed(teacher_seed, "calibrate"))
    dense, _, rows = _sample(t, _CALIBRATION_ROWS, g, "cpu")
    D = dense.shape[1]
    t["dense_mean"] = dense.mean(0) if D else torch.zeros(0)
    t["dense_std"] = dense.std(0).clamp_min(1e-6) if D else torch.ones(0)
    terms = _terms(t, dense, rows).double()  # (n, 4)
    term_weights: tuple[float, ...] = _TERM_WEIGHTS
    if t["seq_len"]:  # after the draws above, so sources without sequences are unchanged
        # ids are not needed here: the teacher row stands in for the target id
        _, mask, seq_rows = _sample_seq(t, _CALIBRATION_ROWS, g, "cpu", rows[:, 0], rows[:, 0])
        terms = torch.cat([terms, _seq_term(t, rows, seq_rows, mask).double()[:, None]], 1)  # (n, 5)
        term_weights = (*_TERM_WEIGHTS, _SEQ_TERM_WEIGHT)
    std = terms.std(0)
    active = std > 1e-9  # e.g. no dense features: those terms are constant and dropped
    weights = torch.tensor(term_weights, dtype=torch.float64) * active
    weights = weights * (logit_std / weights.norm().clamp_min(1e-12))  # ~independent terms
    scale = torch.where(active, weights / std.clamp_min(1e-12), torch.zeros_like(std))
    z = terms @ scale
    z = z - z.mean()
    lo, hi = -40.0, 40.0
    for _ in range(100):  # mean(sigmoid(z + b)) is increasing in b
        mid = 0.5 * (lo + hi)
        if torch.sigmoid(z + mid).mean().item() < base_rate:
            lo = mid
        else:
            hi = mid
    center = (terms @ scale).mean()
    t["term_scale"] = scale.float()
    t["bias"] = torch.tensor(0.5 * (lo + hi) - float(center), dtype=torch.float32)
