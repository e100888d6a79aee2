"""The probe's verdict: per site x GEMM role x candidate, the error and the speed-up.

:class:`ProbeReport` holds one :class:`CandidateResult` per (site, role, candidate, dist):
error (MERE and SQNR, mean and std over the draws), time (measured or modeled) and the two
verdicts, ``safe`` (``mere <= max_error``) and ``fast`` (``speedup >= min_speedup``).
Thresholds can be changed afterwards without measuring again (:meth:`ProbeReport.with_thresholds`).

Outputs: ``to_json`` / ``save`` / ``load`` (versioned JSON; non-finite numbers are written as
the strings ``"nan"`` / ``"inf"``), :meth:`table` (a terminal table: per site and role, the best
safe and fast choice), :meth:`heatmap` (a PNG: rows ``site.role``, columns candidates, colour
log10 MERE, unsafe cells marked ``x``).

Per site, ``meta["sites"][name]`` also says whether its statistics were formed as collected
(``status`` ``"probed"``), whether some fell back to a simpler one (``"fallback"``, with
``fallbacks``: statistic -> why, e.g. ``"x.lowrank"``: the sketch could not be factorised and
the exact diagonal stood in), or whether none could be formed (``"unprobed"``, with
``reason``: nothing measured there, and the search space keeps every candidate of that
site): :meth:`ProbeReport.site_status`, :meth:`~ProbeReport.status_line`,
:meth:`~ProbeReport.sites_table`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

from loka_tune._io import atomic_write_text
from loka_tune.errors import ProbeError

__all__ = ["REPORT_SCHEMA_VERSION", "CandidateResult", "SkippedCandidate", "ProbeReport"]

REPORT_SCHEMA_VERSION = 1
REPORT_KIND = "loka-tune.probe-report"


@dataclass(frozen=True)
class CandidateResult:
    """One candidate GEMM choice at one site and role, under one input distribution."""

    site: str
    role: str  # "fwd" | "dgrad" | "wgrad"
    choice: str  # GemmChoice.short_str()
    m: int  # canonical (m, k, n) of A @ B.T at the site's real M (what the time is for)
    k: int
    n: int
    mere: float  # mean over draws of the mean element-wise relative error
    mere_std: float
    sqnr_db: float  # mean over draws of the SQNR in dB
    sqnr_std: float
    time_s: float
    bf16_time_s: float
    speedup: float  # bf16_time_s / time_s
    time_source: str  # "measured" | "modeled"
    safe: bool
    fast: bool
    dist: str = "learned"  # "learned" | "normal" | "real"
    samples: int = 0  # draws the error is averaged over
    rows: int = 0  # rows M of the sampled operands (<= m of fwd: capped on the CPU)


@dataclass(frozen=True)
class SkippedCandidate:
    """A (site, role, candidate) the probe did not measure, and why."""

    site: str
    role: str
    choice: str
    reason: str


def _enc(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


_FLOAT_FIELDS = ("mere", "mere_std", "sqnr_db", "sqnr_std", "time_s", "bf16_time_s", "speedup")


def _dec_result(d: dict[str, Any]) -> CandidateResult:
    names = {f.name for f in fields(CandidateResult)}
    unknown = set(d) - names
    if unknown:
        raise ProbeError(f"unknown field(s) {sorted(unknown)} in a probe result; valid: {sorted(names)}")
    kw: dict[str, Any] = {k: (float(v) if k in _FLOAT_FIELDS else v) for k, v in d.items()}
    return CandidateResult(**kw)


@dataclass
class ProbeReport:
    """Results of :func:`loka_tune.probe.measure` (see the module docstring)."""

    results: list[CandidateResult] = field(default_factory=list)
    skipped: list[SkippedCandidate] = field(default_factory=list)
    max_error: float = 0.2
    min_speedup: float = 1.05
    meta: dict[str, Any] = field(default_factory=dict)  # measurement settings, sites, provenance
    stats: Any = None  # the ProbeStats measured (not serialized; set by run_probe / measure)

    # ------------------------------------------------------------------ queries
    @property
    def dists(self) -> list[str]:
        return list(dict.fromkeys(r.dist for r in self.results))

    @property
    def primary_dist(self) -> str:
        """``learned`` when present (the probe's answer), else the first distribution measured."""
        d = self.dists
        return "learned" if "learned" in d else (d[0] if d else "learned")

    @property
    def sites(self) -> list[str]:
        return list(dict.fromkeys(r.site for r in self.results))

    @property
    def candidates(self) -> list[str]:
        return list(dict.fromkeys(r.choice for r in self.results))

    def site_status(self) -> dict[str, dict[str, Any]]:
        """Per site (measured or unprobed): ``{"status": "probed" | "fallback" | "unprobed",
        "fallbacks": {statistic: why}, "reason": why (unprobed only)}``. ``fallback``: some
        statistic could not be formed as collected and a simpler one stood in (e.g.
        ``x.lowrank``: the exact diagonal for the sketch); ``unprobed``: nothing could be
        measured, so nothing is pruned there. Reports written before these fields: every
        site with results is ``probed``."""
        out: dict[str, dict[str, Any]] = {}
        meta_sites = self.meta.get("sites", {}) if isinstance(self.meta, dict) else {}
        for name in dict.fromkeys([*meta_sites, *self.sites]):
            m = meta_sites.get(name, {})
            entry: dict[str, Any] = {"status": m.get("status", "probed"), "fallbacks": dict(m.get("fallbacks", {}))}
            if "reason" in m:
                entry["reason"] = m["reason"]
            out[name] = entry
        return out

    @property
    def unprobed(self) -> list[str]:
        """The sites whose statistics could not be formed at all (they keep every candidate)."""
        return [n for n, s in self.site_status().items() if s["status"] == "unprobed"]

    def status_line(self) -> str:
        """One line: how many sites were probed, which fell back (and in which statistics),
        which are unprobed (and why): what the tuner logs after measuring."""
        st = self.site_status()
        fell = {n: s for n, s in st.items() if s["status"] == "fallback"}
        un = {n: s for n, s in st.items() if s["status"] == "unprobed"}
        line = f"{len(st)} sites, {len(st) - len(un)} probed"
        if fell:
            line += f", {len(fell)} with fallbacks (" + "; ".join(
                f"{n}: {', '.join(s['fallbacks'])}" for n, s in list(fell.items())[:6]) + (
                f"; +{len(fell) - 6} more" if len(fell) > 6 else "") + ")"
        if un:
            line += f", {len(un)} unprobed, keeping every candidate (" + "; ".join(
                f"{n}: {s.get('reason', '?')}" for n, s in list(un.items())[:3]) + (
                f"; +{len(un) - 3} more" if len(un) > 3 else "") + ")"
        if not fell and not un:
            line += ", no fallback"
        return line

    def sites_table(self) -> str:
        """Per site: its shape, covariance kind, status and every fallback with its reason."""
        meta_sites = self.meta.get("sites", {}) if isinstance(self.meta, dict) else {}
        rows: list[tuple[str, ...]] = [("site", "K x N", "cov", "status", "fallbacks")]
        for name, s in self.site_status().items():
            m = meta_sites.get(name, {})
            reason = str(s.get("reason", ""))
            fell = [f"{k}: {v}" for k, v in s["fallbacks"].items() if v not in reason]
            why = "; ".join(([reason] if reason else []) + fell)
            shape = f"{m['K']}x{m['N']}" if "K" in m and "N" in m else "-"
            rows.append((name, shape, str(m.get("cov", "-")), s["status"], why or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows)

    def for_site(self, site: str, role: str, dist: str | None = None) -> list[CandidateResult]:
        """The results of one site and role (under ``dist``, default :attr:`primary_dist`)."""
        role = str(getattr(role, "value", role))
        dist = dist or self.primary_dist
        return [r for r in self.results if r.site == site and r.role == role and r.dist == dist]

    def best(self, site: str, role: str, dist: str | None = None) -> CandidateResult | None:
        """The fastest candidate that is safe and fast, else the bf16 result (None if absent)."""
        rs = self.for_site(site, role, dist)
        ok = [r for r in rs if r.safe and r.fast and math.isfinite(r.time_s)]
        if ok:
            return min(ok, key=lambda r: r.time_s)
        bf = [r for r in rs if r.choice.startswith("bf16")]
        return bf[0] if bf else None

    def select(self, dist: str) -> "ProbeReport":
        """A copy holding only the results of ``dist`` (e.g. ``report.select(report.primary_dist)``
        before handing the results to a consumer that does not look at ``dist``)."""
        if dist not in self.dists:
            raise ProbeError(f"no results for distribution {dist!r}; have {self.dists}")
        res = [r for r in self.results if r.dist == dist]
        return ProbeReport(res, list(self.skipped), self.max_error, self.min_speedup, dict(self.meta), self.stats)

    def with_thresholds(self, max_error: float | None = None, min_speedup: float | None = None) -> "ProbeReport":
        """A copy whose verdicts use new thresholds (no re-measurement)."""
        me = self.max_error if max_error is None else float(max_error)
        ms = self.min_speedup if min_speedup is None else float(min_speedup)
        check_thresholds(me, ms)
        res = [replace(r, safe=is_safe(r.mere, me), fast=is_fast(r.speedup, ms)) for r in self.results]
        return ProbeReport(res, list(self.skipped), me, ms, dict(self.meta), self.stats)

    def summary(self) -> dict[str, Any]:
        """Per distribution: counts of results / safe / fast / both, and per candidate the
        geometric-mean MERE over all (site, role) pairs and the safe and fast counts."""
        out: dict[str, Any] = {}
        for dist in self.dists:
            rs = [r for r in self.results if r.dist == dist]
            per: dict[str, Any] = {}
            for c in dict.fromkeys(r.choice for r in rs):
                cr = [r for r in rs if r.choice == c]
                per[c] = {
                    "geomean_mere": _geomean([r.mere for r in cr]),
                    "geomean_speedup": _geomean([r.speedup for r in cr]),
                    "n": len(cr),
                    "safe": sum(r.safe for r in cr),
                    "fast": sum(r.fast for r in cr),
                    "safe_fast": sum(r.safe and r.fast for r in cr),
                }
            out[dist] = {
                "results": len(rs),
                "safe": sum(r.safe for r in rs),
                "fast": sum(r.fast for r in rs),
                "safe_fast": sum(r.safe and r.fast for r in rs),
                "candidates": per,
            }
        return out

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": REPORT_KIND,
            "schema_version": REPORT_SCHEMA_VERSION,
            "max_error": self.max_error,
            "min_speedup": self.min_speedup,
            "meta": self.meta,
            "summary": self.summary(),
            "results": [{k: _enc(v) for k, v in asdict(r).items()} for r in self.results],
            "skipped": [asdict(s) for s in self.skipped],
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(_deep_enc(self.to_dict()), indent=indent, default=str, allow_nan=False)

    def save(self, path: str | Path) -> Path:
        """Write the report as JSON (atomically)."""
        return atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def from_dict(cls, obj: dict[str, Any], *, source: str = "<dict>") -> "ProbeReport":
        if not isinstance(obj, dict) or obj.get("kind") != REPORT_KIND:
            raise ProbeError(f"{source} is not a probe report (kind {REPORT_KIND!r} expected)")
        if obj.get("schema_version") != REPORT_SCHEMA_VERSION:
            raise ProbeError(
                f"{source} has probe-report schema version {obj.get('schema_version')!r}; this"
                f" loka-tune reads version {REPORT_SCHEMA_VERSION}: run the probe again"
            )
        return cls(
            [_dec_result(d) for d in obj.get("results", [])],
            [SkippedCandidate(**d) for d in obj.get("skipped", [])],
            float(obj["max_error"]),
            float(obj["min_speedup"]),
            dict(obj.get("meta", {})),
        )

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> "ProbeReport":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProbeError(f"{source} is not valid JSON (line {e.lineno}: {e.msg})") from None
        return cls.from_dict(obj, source=source)

    @classmethod
    def load(cls, path: str | Path) -> "ProbeReport":
        path = Path(path)
        if not path.is_file():
            raise ProbeError(f"no probe report at {str(path)!r}: run `loka-tune probe ... --out DIR` first")
        return cls.from_json(path.read_text(), source=str(path))

    # ------------------------------------------------------------------ rendering
    def table(self, dist: str | None = None) -> str:
        """A terminal table: per site and role, the best safe-and-fast choice (else bf16),
        its MERE and speed-up, and how many candidates were safe / fast / both; then the
        per-candidate geomean MERE."""
        dist = dist or self.primary_dist
        rows: list[tuple[str, ...]] = [("site", "role", "m x k x n", "best", "MERE", "SQNR dB", "speedup", "safe", "fast", "both")]
        keys = list(dict.fromkeys((r.site, r.role) for r in self.results if r.dist == dist))
        for site, role in keys:
            rs = self.for_site(site, role, dist)
            b = self.best(site, role, dist)
            r0 = rs[0]
            rows.append((
                site, role, f"{r0.m}x{r0.k}x{r0.n}",
                b.choice if b else "-", _fmt(b.mere, 3) if b else "-", _fmt(b.sqnr_db, 1) if b else "-",
                _fmt(b.speedup, 2) if b else "-",
                f"{sum(r.safe for r in rs)}/{len(rs)}", f"{sum(r.fast for r in rs)}/{len(rs)}",
                f"{sum(r.safe and r.fast for r in rs)}/{len(rs)}",
            ))
        out = [f"probe report [{dist}]: max_error {self.max_error:g} MERE, min_speedup {self.min_speedup:g}x,"
               f" time {self._time_sources(dist)}"]
        out.append(_render(rows))
        summ = self.summary().get(dist, {})
        if summ:
            crow: list[tuple[str, ...]] = [("candidate", "geomean MERE", "geomean speedup", "safe", "fast", "both")]
            for c, s in summ["candidates"].items():
                crow.append((c, _fmt(s["geomean_mere"], 4), _fmt(s["geomean_speedup"], 2),
                             f"{s['safe']}/{s['n']}", f"{s['fast']}/{s['n']}", f"{s['safe_fast']}/{s['n']}"))
            out.append("")
            out.append(_render(crow))
        if len(self.dists) > 1:
            others = [d for d in self.dists if d != dist]
            s_all = self.summary()
            lines = ["", "geomean MERE by distribution:"]
            crow = [("candidate", dist, *others)]
            for c in summ.get("candidates", {}):
                crow.append((c, *(_fmt(s_all[d]["candidates"].get(c, {}).get("geomean_mere", math.nan), 4)
                                  for d in (dist, *others))))
            out += lines + [_render(crow)]
        if any(s["status"] != "probed" for s in self.site_status().values()):
            out.append(f"\nsites: {self.status_line()}")
        if self.skipped:
            out.append(f"\n{len(self.skipped)} candidate(s) skipped, e.g. {self.skipped[0].site}"
                       f" {self.skipped[0].role} {self.skipped[0].choice}: {self.skipped[0].reason}")
        return "\n".join(out)

    def _time_sources(self, dist: str) -> str:
        src = sorted({r.time_source for r in self.results if r.dist == dist})
        return "/".join(src) or "-"

    def heatmap(self, path: str | Path, dist: str | None = None, *, title: str | None = None) -> Path:
        """Write a PNG: rows ``site.role``, columns candidates, colour log10 MERE, unsafe = 'x'."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            import numpy as np
        except ImportError as e:  # pragma: no cover - matplotlib is a dependency
            raise ProbeError(f"heatmap needs matplotlib ({e}); pip install matplotlib") from None
        dist = dist or self.primary_dist
        rs = [r for r in self.results if r.dist == dist]
        if not rs:
            raise ProbeError(f"no results for distribution {dist!r}; have {self.dists}")
        rows = list(dict.fromkeys(f"{r.site}.{r.role}" for r in rs))
        cols = list(dict.fromkeys(r.choice for r in rs))
        val = np.full((len(rows), len(cols)), np.nan)
        unsafe = np.zeros_like(val, dtype=bool)
        for r in rs:
            i, j = rows.index(f"{r.site}.{r.role}"), cols.index(r.choice)
            val[i, j] = math.log10(max(r.mere, 1e-12)) if math.isfinite(r.mere) else np.nan
            unsafe[i, j] = not r.safe
        h = max(3.0, 0.28 * len(rows) + 1.8)
        w = max(5.0, 0.55 * len(cols) + 0.07 * max(len(s) for s in rows) + 2.5)
        fig, ax = plt.subplots(figsize=(w, h), dpi=110)
        cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")  # grey: not measured
        im = ax.imshow(np.ma.masked_invalid(val), aspect="auto", cmap=cmap, interpolation="nearest")
        for i, j in zip(*np.nonzero(unsafe)):
            ax.text(j, i, "x", ha="center", va="center", color="red", fontsize=9, fontweight="bold")
        ax.set_xticks(range(len(cols)), cols, rotation=40, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        cb = fig.colorbar(im, ax=ax)
        cb.set_label("log10 MERE")
        ax.set_title(title or f"probe [{dist}]: log10 MERE (x = unsafe, MERE > {self.max_error:g})", fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path


def is_safe(mere: float, max_error: float) -> bool:
    """A candidate's verdict on error: its MERE is finite and at most ``max_error``."""
    return math.isfinite(mere) and mere <= max_error


def is_fast(speedup: float, min_speedup: float) -> bool:
    """A candidate's verdict on speed: its speed-up is finite and at least ``min_speedup``."""
    return math.isfinite(speedup) and speedup >= min_speedup


def check_thresholds(max_error: float, min_speedup: float) -> None:
    """Raise :class:`ProbeError` unless ``max_error > 0`` and ``min_speedup >= 0`` (both finite)."""
    if not (math.isfinite(max_error) and max_error > 0):
        raise ProbeError(f"max_error must be a positive MERE, got {max_error=!r}")
    if not (math.isfinite(min_speedup) and min_speedup >= 0):  # 0: every choice a backend runs is "fast"
        raise ProbeError(f"min_speedup must be a ratio >= 0, got {min_speedup=!r}")


def _geomean(xs: Iterable[float]) -> float:
    vals = [x for x in xs if math.isfinite(x) and x > 0]
    if not vals:
        return math.nan
    return math.exp(math.fsum(math.log(x) for x in vals) / len(vals))


def _fmt(x: float, digits: int) -> str:
    if x is None or not math.isfinite(x):
        return "-" if x is None or math.isnan(x) else ("inf" if x > 0 else "-inf")
    if digits >= 3 and 0 < abs(x) < 10 ** -(digits - 1):
        return f"{x:.{max(digits - 2, 1)}e}"
    return f"{x:.{digits}f}"


def _render(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) if i < 2 or n == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _deep_enc(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deep_enc(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_deep_enc(v) for v in obj]
    return _enc(obj)
