"""What the probe learned about each linear layer, as plain numpy data that saves and loads.

:class:`ProbeStats` maps each site (an ``nn.Linear`` by fully qualified name) to a
:class:`SiteStats`: the input activations ``x`` and output gradients ``dy`` as
:class:`TensorStats` (count, feature mean, covariance or its diagonal + low-rank sketch,
per-feature excess kurtosis, amax, quantiles of ``|x|``, optionally the last captured batch),
and the weight as :class:`WeightStats` (matrix-normal model, see
:mod:`loka_tune.probe.weights`).

Files: ``save(path)`` writes one ``.npz`` (arrays under ``s<i>.<part>.<field>`` keys, no
pickles) whose ``__meta__`` entry is a JSON document with the schema version, the model
fingerprint (site names and shapes, in module order) and every scalar. ``load(path)`` checks
the kind and version; ``check_model(model)`` raises :class:`ProbeError` naming the sites that
differ when the stats were collected on another model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from loka_tune.config import GemmRole
from loka_tune.errors import ProbeError

__all__ = [
    "STATS_SCHEMA_VERSION",
    "QUANTILES",
    "TensorStats",
    "WeightStats",
    "SiteStats",
    "ProbeStats",
    "find_sites",
]

STATS_SCHEMA_VERSION = 1
STATS_KIND = "loka-tune.probe-stats"
_FLOAT_SCALARS = ("amax", "ema", "kurtosis")  # may be 'nan'/'inf' strings in the JSON
# File compaction: symmetric matrices are stored as their upper triangle. Dtypes are kept
# (activation statistics float64: a near-singular covariance rounded to float32 changes its
# Cholesky factor, hence the draws, by far more than 1e-7; the weight model and captured
# batches are float32 already).
_SYMMETRIC = {("x", "cov"), ("dy", "cov"), ("w", "u"), ("w", "v")}
QUANTILES = (0.5, 0.9, 0.99, 0.999)  # quantiles of |x| kept per tensor


def find_sites(model: nn.Module) -> dict[str, nn.Linear]:
    """Eligible sites of ``model`` in module order: ``kernels.linear.find_linears`` when it
    exists (the definition ``apply`` uses), else every ``nn.Linear`` (subclasses included)."""
    try:
        from loka_tune.kernels.linear import find_linears
    except ImportError:
        return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return dict(find_linears(model))


def _arr(a: Any) -> np.ndarray | None:
    return None if a is None else np.asarray(a)


@dataclass
class TensorStats:
    """Statistics of one operand stream (``x`` or ``dy``) of a site; rows are ``(.., dim)`` rows.

    ``cov`` is the full ``(dim, dim)`` covariance (ddof 1) when ``dim <= max_full_dim``; else it
    is ``None`` and ``var`` (exact) + ``lr_vals (r,)``, ``lr_vecs (r, dim)`` (a streaming
    Nystrom sketch, ``cov ~= lr_vecs.T diag(lr_vals) lr_vecs``) describe it.
    ``absq[i]`` is the quantile ``QUANTILES[i]`` of ``|x|``, averaged over collections (each
    on a subsample); ``amax`` the largest ``|x|`` seen. ``real`` is the last captured batch
    (a random subset of its rows, float32) or ``None``.

    ``fallbacks`` names each statistic that could not be formed as collected and what stands
    in for it (:class:`~loka_tune.probe.Probe` read-out): ``"cov"`` / ``"lowrank"`` (the
    covariance or its sketch: replaced by the exact diagonal, ``lr_vals`` / ``lr_vecs`` then
    of rank 0), ``"kurtosis"`` (non-finite entries set to 0). Empty when nothing fell back.
    """

    dim: int
    count: int = 0  # rows merged
    batches: int = 0  # forward calls merged
    nonfinite: int = 0  # batches skipped because they held NaN/inf
    rows: int = 0  # rows per call of the last merged call (the site's M)
    amax: float = 0.0
    mean: np.ndarray | None = None
    var: np.ndarray | None = None
    cov: np.ndarray | None = None
    lr_vals: np.ndarray | None = None
    lr_vecs: np.ndarray | None = None
    kurtosis: np.ndarray | None = None
    absq: np.ndarray | None = None
    real: np.ndarray | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)  # statistic -> why it fell back (see below)

    _ARRAYS = ("mean", "var", "cov", "lr_vals", "lr_vecs", "kurtosis", "absq", "real")
    _SCALARS = ("dim", "count", "batches", "nonfinite", "rows", "amax", "fallbacks")

    @property
    def full(self) -> bool:
        return self.cov is not None

    def covariance(self) -> np.ndarray:
        """The covariance as a dense ``(dim, dim)`` matrix (from the sketch when not full)."""
        if self.cov is not None:
            return self.cov
        assert self.lr_vecs is not None and self.lr_vals is not None  # sketched stats
        low = (self.lr_vecs.T * self.lr_vals) @ self.lr_vecs
        resid = np.clip(self.var - np.diag(low), 0.0, None)
        return low + np.diag(resid)

    def problem(self) -> str | None:
        """Why these stats are unusable, or ``None``."""
        if self.nonfinite:
            return f"{self.nonfinite} collected batch(es) held NaN/inf"
        if self.count == 0:
            return "no rows collected"
        if "var" in self.fallbacks:
            return self.fallbacks["var"]
        for name in self._ARRAYS:
            a = getattr(self, name)
            if a is not None and not np.all(np.isfinite(a)):
                return f"non-finite values in {name}"
        if not math.isfinite(self.amax):
            return "non-finite amax"
        return None


@dataclass
class WeightStats:
    """The matrix-normal model of a weight ``(rows N, cols K)``: ``W ~ M + A Z B^T``.

    ``u`` is ``(N, N)`` or its diagonal ``(N,)``, ``v`` ``(K, K)`` or ``(K,)`` (trace K);
    ``last`` is the weight at the last collection; ``residuals`` counts collections where it
    moved (0: ``u`` is zero and draws equal ``mean``). ``fallbacks``: ``"u"`` / ``"v"`` (a
    factor that could not be formed as fitted: its diagonal stands in), ``"model"`` (no usable
    factor: ``u`` and ``v`` are ``None`` and draws equal ``mean``), ``"fit"`` (a flip-flop
    step that failed: the factors of the collection before were kept).
    """

    rows: int
    cols: int
    count: int = 0
    residuals: int = 0
    nonfinite: int = 0  # collections skipped because the weight held NaN/inf
    ema: float = 0.5
    amax: float = 0.0
    kurtosis: float = 0.0
    mean: np.ndarray | None = None
    last: np.ndarray | None = None
    u: np.ndarray | None = None
    v: np.ndarray | None = None
    absq: np.ndarray | None = None
    fallbacks: dict[str, str] = field(default_factory=dict)  # statistic -> why it fell back

    _ARRAYS = ("mean", "last", "u", "v", "absq")
    _SCALARS = ("rows", "cols", "count", "residuals", "nonfinite", "ema", "amax", "kurtosis", "fallbacks")

    @property
    def has_model(self) -> bool:
        """Whether draws can come from the matrix-normal model (else: the mean weight)."""
        return self.residuals > 0 and self.u is not None and self.v is not None

    def problem(self) -> str | None:
        if self.nonfinite:
            return f"the weight held NaN/inf (or values beyond float32) at {self.nonfinite} collection(s)"
        if self.count == 0:
            return "weight never collected"
        for name in self._ARRAYS:
            a = getattr(self, name)
            if a is not None and not np.all(np.isfinite(a)):
                return f"non-finite values in weight {name}"
        return None


@dataclass
class SiteStats:
    """Everything known about one linear layer: shapes, ``x``, ``dy`` and the weight."""

    name: str
    in_features: int  # K
    out_features: int  # N
    x: TensorStats
    dy: TensorStats
    w: WeightStats
    bias: bool = False

    @property
    def rows(self) -> int:
        """M: rows per forward call of the site (its real batch rows)."""
        return self.x.rows

    def shape(self, role: GemmRole | str) -> tuple[int, int, int]:
        """Canonical ``(m, k, n)`` of the role's ``A @ B.T`` (:meth:`loka_tune.config.GemmRole.shape`)."""
        try:
            r = GemmRole(role)
        except ValueError:
            raise ProbeError(f"unknown GEMM role {role!r}: expected 'fwd', 'dgrad' or 'wgrad'") from None
        return r.shape(self.rows, self.in_features, self.out_features)

    @property
    def fallbacks(self) -> dict[str, str]:
        """``{"x.lowrank": why, "w.u": why, ...}``: every statistic of the site that fell back."""
        return {f"{part}.{k}": why for part in ("x", "dy", "w") for k, why in getattr(self, part).fallbacks.items()}

    def problem(self) -> str | None:
        for part, s in (("x", self.x), ("dy", self.dy)):
            p = s.problem()
            if p is not None:
                if part == "dy" and s.count == 0 and s.nonfinite == 0:
                    return "no output gradients collected (no backward pass during collection steps?)"
                if part == "x" and s.count == 0 and s.nonfinite == 0:
                    return "no inputs collected (the layer was never called in a collection step)"
                return f"{part}: {p}"
        return self.w.problem()


@dataclass
class ProbeStats:
    """Per-site statistics of a probed training run (see the module docstring)."""

    sites: dict[str, SiteStats] = field(default_factory=dict)
    every: int = 100
    steps: int = 0  # training steps the probe counted
    collections: int = 0
    model: str = ""  # class name of the probed model
    meta: dict[str, Any] = field(default_factory=dict)  # free-form (preset, data, ...)

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> list[list[Any]]:
        """``[[name, in_features, out_features], ...]`` in module order."""
        return [[s.name, s.in_features, s.out_features] for s in self.sites.values()]

    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`ProbeError` naming the mismatch when ``model``'s sites differ."""
        found = {n: (m.in_features, m.out_features) for n, m in find_sites(model).items()}
        mine = {s.name: (s.in_features, s.out_features) for s in self.sites.values()}
        missing = [n for n in mine if n not in found]
        extra = [n for n in found if n not in mine]
        shape = [
            f"{n}: stats {mine[n][0]}->{mine[n][1]}, model {found[n][0]}->{found[n][1]}"
            for n in mine
            if n in found and found[n] != mine[n]
        ]
        if missing or extra or shape:
            parts = []
            if missing:
                parts.append(f"sites in the stats but not in the model: {_few(missing)}")
            if extra:
                parts.append(f"sites in the model but not in the stats: {_few(extra)}")
            if shape:
                parts.append(f"shapes differ (in->out): {_few(shape)}")
            raise ProbeError(
                f"these probe stats (model {self.model or '?'}) were collected on another model ("
                + "; ".join(parts)
                + "): probe this model again, or load the stats of the model they came from"
            )

    def problems(self) -> dict[str, str]:
        """``{site: reason}`` for every site whose stats are unusable."""
        out = {}
        for name, s in self.sites.items():
            p = s.problem()
            if p is not None:
                out[name] = p
        return out

    def check(self, sites: list[str] | None = None) -> None:
        """Raise :class:`ProbeError` naming every unusable site (NaN/inf, nothing collected),
        among ``sites`` (default: all)."""
        if not self.sites:
            raise ProbeError("the probe stats hold no sites")
        if self.collections == 0:
            raise ProbeError(
                f"the probe never collected (counted {self.steps} training steps, every={self.every}):"
                " train for at least `every` steps with the model in train mode, or lower `every`"
            )
        probs = self.problems()
        if sites is not None:
            probs = {n: r for n, r in probs.items() if n in sites}
        if probs:
            listed = "; ".join(f"{n}: {r}" for n, r in list(probs.items())[:8])
            more = f" (and {len(probs) - 8} more)" if len(probs) > 8 else ""
            raise ProbeError(
                f"unusable probe statistics in {len(probs)} site(s): {listed}{more}. Fix the"
                " training instability (lower the lr, check the data), or pass skip_bad_sites=True"
                " to measure the other sites"
            )

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write ``path`` (``.npz``; the suffix is added when missing), atomically.

        Symmetric matrices are stored as their upper triangle; a loaded file equals the
        saved stats exactly."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = {}  # Any: np.savez's stub reads **arrays as its keyword options
        site_meta = []
        for i, s in enumerate(self.sites.values()):
            entry: dict[str, Any] = {"name": s.name, "in_features": s.in_features,
                                     "out_features": s.out_features, "bias": s.bias}
            for part in ("x", "dy", "w"):
                obj = getattr(s, part)
                entry[part] = {k: _jsonable(getattr(obj, k)) for k in obj._SCALARS}
                for k in obj._ARRAYS:
                    a = getattr(obj, k)
                    if a is None:
                        continue
                    a = np.asarray(a)
                    key = f"s{i}.{part}.{k}"
                    if (part, k) in _SYMMETRIC and a.ndim == 2:
                        arrays[key + ".tri"] = a[np.triu_indices(a.shape[0])]
                    else:
                        arrays[key] = a
            site_meta.append(entry)
        meta = {
            "kind": STATS_KIND,
            "schema_version": STATS_SCHEMA_VERSION,
            "every": self.every,
            "steps": self.steps,
            "collections": self.collections,
            "model": self.model,
            "fingerprint": self.fingerprint(),
            "meta": self.meta,
            "sites": site_meta,
        }
        arrays["__meta__"] = np.array(json.dumps(meta, default=str))
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path, *, model: nn.Module | None = None) -> "ProbeStats":
        """Read stats written by :meth:`save`; with ``model``, also :meth:`check_model` it."""
        path = Path(path)
        if not path.is_file():
            raise ProbeError(
                f"no probe stats at {str(path)!r}: run `loka-tune probe ... --out DIR` first"
                " (it writes DIR/probe_stats.npz)"
            )
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except Exception as e:  # zip / format errors
            raise ProbeError(f"{str(path)!r} is not a probe stats file (.npz): {e}") from None
        if "__meta__" not in data:
            raise ProbeError(f"{str(path)!r} is a .npz without probe metadata: not written by ProbeStats.save")
        meta = json.loads(str(data["__meta__"]))
        if meta.get("kind") != STATS_KIND:
            raise ProbeError(f"{str(path)!r} holds {meta.get('kind')!r}, not {STATS_KIND!r}")
        if meta.get("schema_version") != STATS_SCHEMA_VERSION:
            raise ProbeError(
                f"{str(path)!r} has schema version {meta.get('schema_version')!r}; this loka-tune"
                f" reads version {STATS_SCHEMA_VERSION}: probe again"
            )
        sites = {}
        for i, entry in enumerate(meta["sites"]):
            parts: dict[str, Any] = {}
            for part, klass in (("x", TensorStats), ("dy", TensorStats), ("w", WeightStats)):
                kw: dict[str, Any] = {k: (float(v) if k in _FLOAT_SCALARS else v) for k, v in entry[part].items()}
                for k in klass._ARRAYS:
                    key = f"s{i}.{part}.{k}"
                    if key in data:
                        kw[k] = data[key]
                    elif key + ".tri" in data:
                        kw[k] = _unpack_sym(data[key + ".tri"])
                parts[part] = klass(**kw)
            sites[entry["name"]] = SiteStats(
                entry["name"], int(entry["in_features"]), int(entry["out_features"]),
                parts["x"], parts["dy"], parts["w"], bool(entry.get("bias", False)),
            )
        stats = cls(
            sites, int(meta["every"]), int(meta["steps"]), int(meta["collections"]),
            str(meta.get("model", "")), dict(meta.get("meta", {})),
        )
        if model is not None:
            stats.check_model(model)
        return stats

    def summary(self) -> str:
        """A short human-readable description (one line per site)."""
        lines = [f"probe stats: {len(self.sites)} sites, {self.collections} collections over"
                 f" {self.steps} steps (every {self.every})"]
        for s in self.sites.values():
            kx = float(np.median(s.x.kurtosis)) if s.x.kurtosis is not None else float("nan")
            lines.append(
                f"  {s.name}: {s.rows}x{s.in_features}->{s.out_features}  x amax {s.x.amax:.3g}"
                f" kurt(med) {kx:.2f}  dy amax {s.dy.amax:.3g}  w amax {s.w.amax:.3g}"
            )
        return "\n".join(lines)


def _unpack_sym(tri: np.ndarray) -> np.ndarray:
    d = int(round((math.sqrt(8 * tri.size + 1) - 1) / 2))  # tri.size = d (d + 1) / 2
    out = np.zeros((d, d), dtype=tri.dtype)
    iu = np.triu_indices(d)
    out[iu] = tri
    out.T[iu] = tri
    return out


def _few(items: list[str], k: int = 5) -> str:
    shown = ", ".join(repr(x) if not isinstance(x, str) or ":" not in x else x for x in items[:k])
    return shown + (f" (+{len(items) - k} more)" if len(items) > k else "")


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # 'nan' / 'inf': json.dumps would write invalid JSON
    return v
