"""Probe, offline half: synthetic replay, error metrics, measurement, speed, the report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from loka_tune.config import GemmChoice
from loka_tune.errors import ProbeError
from loka_tune.kernels.quant import mere, sqnr_db
from loka_tune.probe import DEFAULT_MAX_ERROR, Probe, ProbeReport, ProbeStats, measure, run_probe
from loka_tune.probe.measure import GUARD_FRAC
from loka_tune.probe.speed import RooflineSpeed, TimedSpeed
from loka_tune.probe.synth import SiteSampler, psd_factor


def _probe_linear(x_fn, k: int = 16, n: int = 8, steps: int = 6, every: int = 1, seed: int = 0, **kw) -> ProbeStats:
    """Stats of one nn.Linear(k, n) fed ``x_fn(step)`` rows, trained by SGD on a random linear loss."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    c = torch.randn(n)
    with Probe(model, every=every, **kw) as p:
        for i in range(steps):
            opt.zero_grad()
            y = model(x_fn(i))
            (y * c + 0.5 * y * y).mean().backward()  # dY (M, N) = (c + y) / (M N)
            opt.step()
    return p.stats


@pytest.fixture(scope="module")
def gauss_stats() -> ProbeStats:
    g = torch.Generator().manual_seed(5)
    mix = torch.randn(16, 16, generator=g) / 4
    return _probe_linear(lambda i: torch.randn(256, 16, generator=g) @ mix + torch.linspace(-1, 2, 16))


# ---------------------------------------------------------------------------- synthetic replay
@pytest.mark.parametrize("sketch", [False, True], ids=["full_cov", "diag_lowrank"])
def test_synthetic_rows_reproduce_mean_and_covariance(sketch: bool) -> None:
    g = torch.Generator().manual_seed(0)
    low = torch.randn(3, 16, generator=g) * 2
    scale = torch.logspace(-1, 0.5, 16)

    def x_fn(i: int) -> torch.Tensor:
        return (torch.randn(512, 3, generator=g) @ low + torch.randn(512, 16, generator=g) * scale) + 3.0

    stats = _probe_linear(x_fn, steps=4, **({"max_full_dim": 8, "sketch_rank": 8} if sketch else {}))
    t = stats.sites["0"].x
    assert t.full is (not sketch)
    smp = SiteSampler(stats.sites["0"], "learned", seed=1)
    assert smp.rows == 512  # the site's M
    x = np.concatenate([smp.draw()[0] for _ in range(40)])
    rows = x.shape[0]
    cov = t.covariance()  # what the sampler should reproduce (the sketch's model when sketched)
    sd = np.sqrt(np.diag(cov))
    # mean: each feature's sample mean has std sd / sqrt(n): allow 5 of them
    assert np.all(np.abs(x.mean(0) - t.mean) <= 5 * sd / math.sqrt(rows))
    # covariance: var(s_ij) = (s_ii s_jj + s_ij^2) / n for Gaussian rows: allow 5 std
    tol = 5 * np.sqrt((np.outer(sd**2, sd**2) + cov**2) / rows)
    assert np.all(np.abs(np.cov(x, rowvar=False) - cov) <= tol)
    if sketch:  # the exact diagonal is kept; the low-rank part carries most of the covariance
        np.testing.assert_allclose(np.diag(cov), t.var, rtol=1e-12)
        full = stats.sites["0"].x
        assert np.linalg.norm(t.covariance(), 2) > 0.9 * np.linalg.norm(np.diag(full.var), 2)


def test_psd_factor_jitter_escalation_and_clipping() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 2))
    singular = a @ a.T  # rank 2
    lf, j = psd_factor(singular)
    assert j >= 0 and np.allclose(lf @ lf.T, singular, atol=1e-6 * np.abs(singular).max())
    indefinite = np.diag([1.0, 2.0, -0.5])
    lf, j = psd_factor(indefinite)
    assert math.isnan(j)
    np.testing.assert_allclose(lf @ lf.T, np.diag([1.0, 2.0, 0.0]), atol=1e-12)
    lf, j = psd_factor(np.zeros((3, 3)))
    assert not lf.any()


def test_sampler_errors_and_real_replay(gauss_stats: ProbeStats) -> None:
    site = gauss_stats.sites["0"]
    with pytest.raises(ProbeError, match="unknown distribution"):
        SiteSampler(site, "uniform")
    real = SiteSampler(site, "real")
    x, dy, w = real.draw()
    assert x.shape == (256, 16) and dy.shape == (256, 8)
    np.testing.assert_array_equal(w, site.w.last)
    norm = SiteSampler(site, "normal", max_rows=100)
    x, dy, w = norm.draw()
    assert x.shape == (100, 16) and abs(x.mean()) < 0.2 and abs(x.std() - 1) < 0.1
    stats = _probe_linear(lambda i: torch.randn(8, 16), keep_real=False, steps=2)
    with pytest.raises(ProbeError, match="keep_real=True"):
        SiteSampler(stats.sites["0"], "real")


# ---------------------------------------------------------------------------- metrics
def test_mere_and_sqnr_definitions() -> None:
    ref = torch.tensor([1.0, -2.0, 4.0, 0.0], dtype=torch.float64)
    out = ref * 1.1
    rms = math.sqrt((1 + 4 + 16) / 4)
    # |err|/|ref| = 0.1 for the three non-zeros; the zero is exact
    assert mere(ref, out) == pytest.approx(0.3 / 4)
    out2 = ref.clone()
    out2[3] = 0.01
    assert mere(ref, out2) == pytest.approx(0.01 / (GUARD_FRAC * rms) / 4)  # guarded, not infinite
    assert mere(ref, out2, guard_frac=0.1) == pytest.approx(0.01 / (0.1 * rms) / 4)
    assert mere(out2, ref) != mere(ref, out2)  # reference first: the guard is rms(ref)
    assert sqnr_db(ref, out) == pytest.approx(20.0)  # err = 0.1 ref -> 20 dB
    assert sqnr_db(ref, ref) == math.inf
    assert mere(ref, ref) == 0.0


# ---------------------------------------------------------------------------- measure
CANDS = ["e4m3.tensor.emulated", "e4m3.row.emulated", "e5m2+e4m3.row.emulated", "mxfp8.mx.emulated"]


@pytest.fixture(scope="module")
def report(gauss_stats: ProbeStats) -> ProbeReport:
    return measure(gauss_stats, CANDS, samples=6, dists=("learned", "normal", "real"))


def test_measure_errors_shapes_and_verdicts(report: ProbeReport) -> None:
    assert report.candidates[0] == "bf16"  # the baseline is added
    assert set(report.dists) == {"learned", "normal", "real"}
    r = {(x.role, x.choice, x.dist): x for x in report.results}
    # canonical shapes at the site's real M (256 rows per call)
    assert (r["fwd", "bf16", "learned"].m, r["fwd", "bf16", "learned"].k, r["fwd", "bf16", "learned"].n) == (256, 16, 8)
    assert (r["dgrad", "bf16", "learned"].m, r["dgrad", "bf16", "learned"].k, r["dgrad", "bf16", "learned"].n) == (256, 8, 16)
    assert (r["wgrad", "bf16", "learned"].m, r["wgrad", "bf16", "learned"].k, r["wgrad", "bf16", "learned"].n) == (8, 256, 16)
    assert ("fwd", "e5m2+e4m3.row.emulated", "learned") not in r
    assert any(s.role == "fwd" and s.choice.startswith("e5m2") and "gradient" in s.reason for s in report.skipped)
    for role in ("fwd", "dgrad", "wgrad"):
        bf = r[role, "bf16", "normal"]
        e4 = r[role, "e4m3.row.emulated", "normal"]
        assert bf.mere < 0.05 and bf.sqnr_db > 40 and bf.speedup == pytest.approx(1.0)
        assert 0.08 < e4.mere < DEFAULT_MAX_ERROR and 24 < e4.sqnr_db < 33  # 3 mantissa bits
        assert e4.samples == 6 and e4.mere_std > 0 and e4.time_source == "modeled"
        if role != "fwd":
            e5 = r[role, "e5m2+e4m3.row.emulated", "normal"]
            assert e5.mere > 1.3 * e4.mere and e5.sqnr_db < e4.sqnr_db - 2  # one mantissa bit fewer
        assert r[role, "e4m3.row.emulated", "real"].samples == 1
        assert r[role, "e4m3.row.emulated", "real"].mere_std == 0.0
        for x in (bf, e4):
            assert x.safe == (x.mere <= report.max_error) and x.fast == (x.speedup >= report.min_speedup)
    # mxfp8 has no modeled backend on Hopper: no time, never fast
    mx = r["fwd", "mxfp8.mx.emulated", "learned"]
    assert math.isnan(mx.time_s) and not mx.fast


def test_learned_distributions_expose_what_random_inputs_miss() -> None:
    """Inputs with a large component along u and a weight orthogonal to u: Y = X W^T cancels
    it exactly, but the quantization error of X (~4% of |X|) does not cancel. Only the
    learned covariance carries this; on standard-normal operands every e4m3 GEMM looks fine."""
    g = torch.Generator().manual_seed(3)
    k, n = 16, 8
    u = torch.randn(k, generator=g)
    u /= u.norm()
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) @ (torch.eye(k) - torch.outer(u, u)))
    model = nn.Sequential(lin)
    with Probe(model, every=1) as p:
        for _ in range(3):
            x = 20 * torch.randn(512, 1, generator=g) * u + torch.randn(512, k, generator=g)  # (M, K)
            (model(x) * torch.randn(512, n, generator=g)).sum().backward()
    cands = ["e4m3.tensor.emulated", "e4m3.row.emulated", "e4m3.block.emulated"]
    rep = measure(p.stats, cands, samples=4, roles=["fwd"], dists=("learned", "normal"))
    for c in cands:
        learned = next(r for r in rep.results if r.choice == c and r.dist == "learned")
        normal = next(r for r in rep.results if r.choice == c and r.dist == "normal")
        assert learned.mere > 3 * normal.mere and learned.sqnr_db < normal.sqnr_db - 10, c
        assert not learned.safe and normal.safe
    assert rep.best("0", "fwd").choice == "bf16"


def test_weight_model_draws_predict_the_current_weight_errors() -> None:
    g = torch.Generator().manual_seed(6)
    mix = torch.randn(64, 64, generator=g) / 8
    stats = _probe_linear(lambda i: torch.randn(512, 64, generator=g) @ mix + 0.5, k=64, n=32, steps=8)
    assert stats.sites["0"].w.residuals == 7
    kw = dict(samples=8, dists=("learned",), seed=1)
    cands = ["e4m3.tensor.emulated", "e4m3.row.emulated"]
    a = measure(stats, cands, weights="model", **kw)
    b = measure(stats, cands, weights="current", **kw)
    for ra, rb in zip(a.results, b.results):
        assert (ra.site, ra.role, ra.choice) == (rb.site, rb.role, rb.choice)
        assert ra.mere == pytest.approx(rb.mere, rel=0.1), (ra.role, ra.choice)


def test_measure_is_deterministic_and_validates(gauss_stats: ProbeStats) -> None:
    a = measure(gauss_stats, ["e4m3.row.emulated"], samples=2, dists=("learned",), seed=7)
    b = measure(gauss_stats, ["e4m3.row.emulated"], samples=2, dists=("learned",), seed=7)
    assert [r.mere for r in a.results] == [r.mere for r in b.results]
    with pytest.raises(ProbeError, match="samples"):
        measure(gauss_stats, samples=0)
    with pytest.raises(ProbeError, match="unknown distribution"):
        measure(gauss_stats, dists=("uniform",))
    with pytest.raises(ProbeError, match="bad candidate 'e4m3.rows.emulated'"):
        measure(gauss_stats, ["e4m3.rows.emulated"])
    with pytest.raises(ProbeError, match="unknown site"):
        measure(gauss_stats, sites=["nope"])
    with pytest.raises(ProbeError, match="max_error"):
        measure(gauss_stats, max_error=0)
    with pytest.raises(ProbeError, match="ProbeStats"):
        measure({"not": "stats"})



def test_measure_says_where_its_time_went(report: ProbeReport) -> None:
    """The report's timers (what the study's probe log line prints): the replay's factors, the
    draws and the GEMMs with their errors add up to at most the whole, every site is timed."""
    from loka_tune.tuner.prepare import _measure_note

    ph, per_site = report.meta["phases_s"], report.meta["site_s"]
    assert set(ph) == {"replay", "draws", "gemms"} and all(v >= 0 for v in ph.values())
    assert ph["gemms"] > 0 and ph["draws"] > 0
    assert sum(ph.values()) <= report.meta["measure_s"] + 1e-3
    assert set(per_site) == {"0"} and per_site["0"] <= report.meta["measure_s"] + 1e-3
    note = _measure_note(report.meta)
    assert note.startswith(": replay factors ") and ", draws " in note and ", GEMMs and errors " in note
    assert note.endswith(f"; slowest sites 0 {per_site['0']:.1f}s")
    assert _measure_note({}) == ""

# ---------------------------------------------------------------------------- speed
def test_roofline_and_timed_speed() -> None:
    rf = RooflineSpeed()
    bf, fp8 = GemmChoice(), GemmChoice.parse("e4m3.row.emulated")
    small = rf.seconds(fp8, 1024, 64, 64, "fwd")[0] / rf.seconds(bf, 1024, 64, 64, "fwd")[0]
    big = rf.seconds(fp8, 16384, 8192, 8192, "fwd")[0] / rf.seconds(bf, 16384, 8192, 8192, "fwd")[0]
    assert small > 1.5 and big < 0.7  # quantization + launches lose on small GEMMs, FP8 wins on big

    class Cache:
        def lookup(self, choice, m, k, n, role, device="h200"):
            return 1e-5 if choice.short_str() == "e4m3.row.fbgemm" else None

    ts = TimedSpeed(Cache(), rf)
    assert ts.seconds(fp8, 8, 8, 8, "fwd") == (1e-5, "measured")
    assert ts.seconds(bf, 8, 8, 8, "fwd")[1] == "modeled"


def test_timed_speed_reads_a_gpu_timing_cache_on_the_cpu(tmp_path) -> None:
    from loka_tune.kernels.timing import TimingCache

    gpu = TimingCache(tmp_path / "t.json", device="NVIDIA H200", versions="torch=2.9.0")
    gpu.put("e4m3.row.fbgemm", 64, 32, 16, "fwd", 2e-5)
    gpu.put("e4m3.row.torch_scaled_mm", 64, 32, 16, "fwd", 1e-5)
    gpu.put("bf16", 64, 32, 16, "fwd", 3e-5)
    ts = TimedSpeed(TimingCache(tmp_path / "t.json"), RooflineSpeed(), device="h200")  # read back on this host
    # emulated numerics: the fastest real backend that measured them
    assert ts.seconds(GemmChoice.parse("e4m3.row.emulated"), 64, 32, 16, "fwd") == (1e-5, "measured")
    assert ts.seconds(GemmChoice.parse("e4m3.row.fbgemm"), 64, 32, 16, "fwd") == (2e-5, "measured")
    assert ts.seconds(GemmChoice(), 64, 32, 16, "fwd") == (3e-5, "measured")
    assert ts.seconds(GemmChoice.parse("e4m3.tensor.emulated"), 64, 32, 16, "fwd")[1] == "modeled"
    assert TimedSpeed(TimingCache(tmp_path / "t.json"), RooflineSpeed(), device="b200").seconds(
        GemmChoice(), 64, 32, 16, "fwd")[1] == "modeled"  # measured on another GPU: not used


def test_measure_with_a_custom_speed_model(gauss_stats: ProbeStats) -> None:
    class Fixed:
        def seconds(self, choice, m, k, n, role):
            return (1.0 if choice.is_bf16 else 0.5), "measured"

    rep = measure(gauss_stats, ["e4m3.row.emulated"], samples=1, dists=("normal",), speed_model=Fixed())
    fp8 = [r for r in rep.results if r.choice != "bf16"]
    assert all(r.speedup == 2.0 and r.fast and r.time_source == "measured" for r in fp8)
    assert rep.best("0", "fwd").choice == "e4m3.row.emulated"


# ---------------------------------------------------------------------------- the report
def test_report_roundtrip_table_heatmap_thresholds(report: ProbeReport, tmp_path) -> None:
    path = report.save(tmp_path / "r.json")
    text = path.read_text()
    json.loads(text)  # strict JSON: NaN times were written as "nan"
    assert "NaN" not in text
    back = ProbeReport.load(path)
    assert len(back.results) == len(report.results) and back.skipped == report.skipped
    for a, b in zip(report.results, back.results):
        for f in ("mere", "sqnr_db", "time_s", "speedup"):
            va, vb = getattr(a, f), getattr(b, f)
            assert (math.isnan(va) and math.isnan(vb)) or va == vb
        assert (a.site, a.role, a.choice, a.dist, a.safe, a.fast) == (b.site, b.role, b.choice, b.dist, b.safe, b.fast)
    summ = report.summary()
    assert set(summ) == {"learned", "normal", "real"}
    c = summ["normal"]["candidates"]
    assert c["e5m2+e4m3.row.emulated"]["geomean_mere"] > c["e4m3.row.emulated"]["geomean_mere"] > c["bf16"]["geomean_mere"]
    table = report.table()
    assert "probe report [learned]" in table and "e4m3.row.emulated" in table and "0  " in table
    assert "geomean MERE by distribution" in table
    strict = report.with_thresholds(max_error=0.05)
    assert sum(r.safe for r in strict.results) < sum(r.safe for r in report.results)
    assert all(r.safe == (r.mere <= 0.05) for r in strict.results)
    assert len(report.for_site("0", "dgrad", "normal")) == 5  # bf16 + 4 candidates
    only = report.select("learned")
    assert only.dists == ["learned"] and len(only.results) == len(report.results) // 3
    with pytest.raises(ProbeError, match="no results for distribution"):
        report.select("nope")
    png = report.heatmap(tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with pytest.raises(ProbeError, match="no results for distribution"):
        report.heatmap(tmp_path / "x.png", dist="nope")
    with pytest.raises(ProbeError, match="not a probe report"):
        ProbeReport.from_json('{"kind": "other"}')


# ---------------------------------------------------------------------------- run_probe
def test_run_probe_trains_then_measures_and_reanalyses(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))

    def train_fn(m: nn.Module, source) -> None:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for x in source:
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()

    data = [torch.randn(32, 6) for _ in range(6)]
    rep = run_probe(model, data, ["e4m3.row.emulated"], train_fn=train_fn, every=2, samples=2)
    assert rep.sites == ["0", "2"] and rep.stats.collections == 3
    path = rep.stats.save(tmp_path / "s.npz")
    again = run_probe(model, candidates=["e4m3.row.emulated"], stats=path, samples=2)
    assert [r.mere for r in again.results] == [r.mere for r in rep.results]  # same stats, same draws
    with pytest.raises(ProbeError, match="train_fn"):
        run_probe(model, data)
    with pytest.raises(ProbeError, match="another model"):
        run_probe(nn.Sequential(nn.Linear(6, 3)), stats=path)
    with pytest.raises(ProbeError, match="never collected"):
        run_probe(model, data[:1], train_fn=train_fn, every=5)


def test_e5m2_anywhere_measures_e5m2_weights_and_activations(gauss_stats: ProbeStats) -> None:
    """Outside the search space, for calibration: e5m2 for every operand, and larger errors than e4m3."""
    cands = ["e4m3.row.emulated", "e5m2.row.emulated"]
    plain = measure(gauss_stats, cands, samples=3)
    assert not [x for x in plain.results if x.choice == "e5m2.row.emulated"]
    rep = measure(gauss_stats, cands, samples=3, e5m2_anywhere=True)
    r = {(x.role, x.choice): x.mere for x in rep.results}
    for role in ("fwd", "dgrad", "wgrad"):
        assert r[role, "e5m2.row.emulated"] > 1.5 * r[role, "e4m3.row.emulated"]  # 2 vs 3 mantissa bits


def test_speed_row_scale_prices_the_production_batch(gauss_stats: ProbeStats) -> None:
    base = measure(gauss_stats, ["e4m3.row.emulated"], samples=2, roles=["fwd"])
    big = measure(gauss_stats, ["e4m3.row.emulated"], samples=2, roles=["fwd"], speed_row_scale=256.0)
    b = {(x.choice, x.dist): x for x in base.results}
    g = {(x.choice, x.dist): x for x in big.results}
    k = ("e4m3.row.emulated", "learned")
    assert g[k].m == 256 * b[k].m and (g[k].k, g[k].n) == (b[k].k, b[k].n)
    assert g[k].mere == b[k].mere  # errors come from the same draws: only the priced shape changes
    assert g[k].speedup > b[k].speedup  # FP8 pays off with more rows (cost model)
    with pytest.raises(ProbeError, match="speed_row_scale"):
        measure(gauss_stats, ["e4m3.row.emulated"], samples=1, speed_row_scale=0)


def test_price_first_measures_only_the_fast_and_the_space_drops_the_rest(gauss_stats: ProbeStats) -> None:
    """Issue 13's cheap preparation: speed is priced before any error is measured."""
    from loka_tune.space.candidates import SearchSpace, SiteChoices, prune_by_probe
    from loka_tune.space.sites import Site

    class Priced:  # e4m3 rowwise 2x faster than bf16, e4m3 tensorwise slower
        def seconds(self, choice, m, k, n, role):
            return {"bf16": 1.0, "e4m3.row.emulated": 0.5}.get(choice.short_str(), 1.5), "modeled"

    cands = ["e4m3.row.emulated", "e4m3.tensor.emulated"]
    full = measure(gauss_stats, cands, samples=1, dists=("normal",), speed_model=Priced(), roles=["fwd"])
    cheap = measure(gauss_stats, cands, samples=1, dists=("normal",), speed_model=Priced(), roles=["fwd"],
                    price_first=True, min_speedup=1.0)
    assert {r.choice for r in full.results} == {"bf16", *cands}
    assert {r.choice for r in cheap.results} == {"bf16", "e4m3.row.emulated"}
    slow = [s for s in cheap.skipped if s.choice == "e4m3.tensor.emulated"]
    assert len(slow) == 1 and slow[0].reason.startswith("slow: speed-up 0.667")
    fast = {r.choice: r.mere for r in cheap.results}
    assert fast["e4m3.row.emulated"] == {r.choice: r.mere for r in full.results}["e4m3.row.emulated"]
    space = SearchSpace((SiteChoices(Site("0", 16, 8, 256.0), {"fwd": ("bf16", *cands)}),))
    pruned = prune_by_probe(space, cheap.results, max_error=10.0, min_speedup=1.0, skipped=cheap.skipped)
    sc = pruned.sites[0]
    assert sc.choices["fwd"] == ("bf16", "e4m3.row.emulated")
    assert sc.dropped["fwd"]["e4m3.tensor.emulated"].startswith("slow:")
    # without the skipped list an unmeasured candidate is kept (the old rule)
    assert prune_by_probe(space, cheap.results, max_error=10.0).sites[0].choices["fwd"] == ("bf16", *cands)


def test_a_linear_called_twice_per_step_is_priced_at_both_calls_rows() -> None:
    """As the tuner's cost model (``discover_sites`` sums the rows of every call): the probe's
    speed of a Linear used twice is that of its two calls' rows, not of one call."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared, self.once = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.once(self.shared(torch.relu(self.shared(x))))

    torch.manual_seed(0)
    model = Twice()
    with Probe(model, every=1) as p:
        for _ in range(3):
            model(torch.randn(64, 32)).square().mean().backward()
    stats = p.stats
    rep = measure(stats, ["e4m3.row.emulated"], samples=1, speed_model=RooflineSpeed(), speed_row_scale=2.0)
    shape = {(r.site, r.role): (r.m, r.k, r.n) for r in rep.results if r.choice == "e4m3.row.emulated"}
    assert shape[("shared", "fwd")] == (2 * 64 * 2, 32, 32)  # two calls of 64 rows, priced at twice the batch
    assert shape[("once", "fwd")] == (64 * 2, 32, 32)
    assert shape[("shared", "wgrad")] == (32, 2 * 64 * 2, 32)  # wgrad reduces over the rows
