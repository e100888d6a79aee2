"""The additive model of a recipe space: predicted step time and loss of a config, fitted to trials,
and the frontier it proposes under the loss budget.

A config picks one value ``v_s`` per site ``s`` (:mod:`loka_tune.space.recipe_space`; sites
without a parameter are bf16). With ``saved_s(v)`` the site's price (seconds per training step
the value saves against the site in bf16, :attr:`SiteChoices.prices`) and ``e_s(v)`` its loss
sensitivity::

    e_s(v)           = sum over the GEMMs g of v that are not bf16 of MERE_s,g(v_g)
                       (the probe's error, SiteChoices.error; a GEMM it did not measure:
                       ``unmeasured_error``, by default the pruning threshold probe.max_error,
                       the worst error a kept choice may have)
    step_s(config)   = base_s - beta * sum_s saved_s(v_s)
    relLL%(config)   = mods_rel_pct + alpha * sum_s e_s(v_s)

``base_s`` is the step time of bf16 with the config's Mods (before any trial: the baseline's),
``mods_rel_pct`` the relative log loss of bf16 with those Mods (0 without Mods). Both scales are
fitted to the finished trials ``i`` by least squares through the origin, clipped at 0:

    beta  = sum_i P_i M_i / sum_i P_i^2   P_i = sum_s saved_s(v_s): predicted saving of trial i,
                                          M_i = its bf16 + Mods step time - its step time (COMPLETE
                                          trials with P_i > 0); no such trial: beta = 1
    alpha = sum_i E_i Y_i / sum_i E_i^2   E_i = sum_s e_s(v_s), Y_i = shrink(its relLL% - mods_rel_pct
                                          of its Mods) (trials with E_i > 0 whose Mods' bf16 relLL% is
                                          known; a pruned trial enters at max(its relLL%, the budget):
                                          it was hopeless); no such trial: alpha = ALPHA_PRIOR
    shrink(y)        = sign(y) * max(|y| - noise_pct, 0): a difference within the baseline's noise
                       floor cannot be told from bf16's own (results.within_noise), so it counts 0;
                       without this, two 40-step trials whose +0.3% is noise (floor 0.43%) set
                       alpha to 5.5%/MERE and the frontier to bf16

:data:`ALPHA_PRIOR` is conservative: the largest relLL% per unit of summed MERE among the configs
of ``benchmarks/results/probe_vs_loss_harsh.json`` (400-step paired runs of tiny Wukong and DLRM,
one choice on every GEMM but the head's; its geometric-mean MERE times the GEMM count stands in
for the sum, which it never exceeds, so each ratio is an upper bound): 0.397, DLRM "mixed" (9
GEMMs, geometric mean 0.074, relLL +0.266%), rounded up to 0.4. (A least-squares fit over all 20
configs gives 0.055.)

The frontier (:meth:`AdditiveModel.frontier`): the config of largest predicted saving whose
predicted relLL% is within ``margin`` x the budget: a multiple-choice knapsack (one value per
site), solved exactly up to a cost grid of :data:`GRID` cells, each cost rounded up (so a point
never exceeds its capacity).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loka_tune.config import ROLES, SitePrecision
from loka_tune.space.candidates import BF16_ID, SearchSpace, SiteChoices

__all__ = ["ALPHA_PRIOR", "GRID", "Observation", "AdditiveModel", "sensitivity"]

#: relLL% per unit of summed MERE before any FP8 trial has finished (see the module docstring)
ALPHA_PRIOR = 0.4
#: cells of the knapsack's cost grid (exact up to one cell: costs are rounded up)
GRID = 512


def sensitivity(sc: SiteChoices, value: str, unmeasured_error: float) -> float:
    """``e_s(value)``: the sum of the probe's MERE over the value's GEMMs that are not bf16."""
    prec = SitePrecision.parse(value)
    total = 0.0
    for r in ROLES:
        cid = prec[r].short_str()
        if cid == BF16_ID:
            continue
        e = sc.error.get(r.value, {}).get(cid)
        total += float(unmeasured_error if e is None or not math.isfinite(e) else e)
    return total


@dataclass(frozen=True)
class Observation:
    """One finished trial, as the model reads it.

    ``values``: site -> value (sites absent: bf16); ``mods``: its Mods' short_str (``"none"``);
    ``state``: ``"COMPLETE"`` or ``"PRUNED"``; ``step_s`` / ``ref_s``: its step time and bf16
    with the same Mods' (None where unknown); ``rel_pct``: its relative log loss in percent.
    """

    values: Mapping[str, str]
    mods: str
    state: str
    step_s: float | None
    ref_s: float | None
    rel_pct: float | None


def _num(x: float | None) -> float | None:
    """``x`` as a float when it is a finite number, else None."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


@dataclass(frozen=True)
class AdditiveModel:
    """Additive per-site savings and loss sensitivities (the module's formulas), with fitted scales."""

    space: SearchSpace
    alpha: float = ALPHA_PRIOR
    beta: float = 1.0
    unmeasured_error: float = 0.2
    n_alpha: int = 0  # trials alpha was fitted on (0: the prior)
    n_beta: int = 0  # trials beta was fitted on (0: 1.0)
    mods_rel: Mapping[str, float] = field(default_factory=dict)  # Mods short_str -> bf16's relLL%

    # ------------------------------------------------------------------ per config
    def saving(self, values: Mapping[str, str]) -> float:
        """``sum_s saved_s(v_s)``, before the scale beta (seconds per step)."""
        return sum(float(self.space.site(s).prices.get(v, 0.0)) for s, v in values.items() if v != BF16_ID)

    def sens(self, values: Mapping[str, str]) -> float:
        """``sum_s e_s(v_s)``."""
        return sum(sensitivity(self.space.site(s), v, self.unmeasured_error) for s, v in values.items()
                   if v != BF16_ID)

    def predict_step(self, values: Mapping[str, str], base_s: float) -> float:
        return base_s - self.beta * self.saving(values)

    def predict_rel(self, values: Mapping[str, str], mods: str = "none") -> float:
        return self.mods_rel.get(mods, 0.0) + self.alpha * self.sens(values)

    # ------------------------------------------------------------------ fitting
    def fit(self, observations: Iterable[Observation], *, budget_pct: float, noise_pct: float = 0.0) -> AdditiveModel:
        """A copy with ``alpha``, ``beta`` and the Mods' bf16 losses fitted to ``observations``
        (``noise_pct``: the baseline's noise floor, in percent)."""
        obs = [o for o in observations if o.state in ("COMPLETE", "PRUNED")]
        mods_rel: dict[str, float] = {"none": 0.0}
        for o in obs:  # bf16 under some Mods: that Mods' own loss
            rel = _num(o.rel_pct)
            if o.state == "COMPLETE" and rel is not None and all(v == BF16_ID for v in o.values.values()):
                mods_rel.setdefault(o.mods, rel)
        bn = bd = an = ad = 0.0
        nb = na = 0
        for o in obs:
            p, e = self.saving(o.values), self.sens(o.values)
            step, ref, rel = _num(o.step_s), _num(o.ref_s), _num(o.rel_pct)
            if o.state == "COMPLETE" and p > 0 and step is not None and ref is not None:
                bn += p * (ref - step)
                bd += p * p
                nb += 1
            if e > 0 and o.mods in mods_rel and rel is not None:
                y = max(rel, budget_pct) if o.state == "PRUNED" else rel
                d = y - mods_rel[o.mods]
                an += e * math.copysign(max(abs(d) - noise_pct, 0.0), d)
                ad += e * e
                na += 1
        beta = max(bn / bd, 0.0) if nb else 1.0
        alpha = max(an / ad, 0.0) if na else ALPHA_PRIOR
        return AdditiveModel(self.space, alpha=alpha, beta=beta, unmeasured_error=self.unmeasured_error,
                             n_alpha=na, n_beta=nb, mods_rel=mods_rel)

    # ------------------------------------------------------------------ the frontier
    def frontier(self, capacity_pct: float) -> dict[str, str]:
        """The values (site -> value, every site with a parameter) of largest predicted saving
        whose ``alpha * sum e_s`` is at most ``capacity_pct`` (bf16 everywhere if nothing fits)."""
        import numpy as np

        sites = [sc for sc in self.space.sites if len(sc.values) > 1]
        out = {sc.name: BF16_ID for sc in sites}
        if capacity_pct < 0 or not sites or self.beta <= 0:
            return out
        options: list[list[tuple[str, float, float]]] = []  # per site: (value, saving, cost)
        for sc in sites:
            opts = [(BF16_ID, 0.0, 0.0)]
            for v in sc.values[1:]:
                p = float(sc.prices.get(v, 0.0))
                c = self.alpha * sensitivity(sc, v, self.unmeasured_error)
                if p > 0 and c <= capacity_pct:
                    opts.append((v, p, c))
            options.append(opts)
        if all(c == 0.0 for opts in options for _, _, c in opts):  # nothing costs: the largest saving per site
            return {sc.name: max(opts, key=lambda o: o[1])[0] for sc, opts in zip(sites, options)}
        cell = capacity_pct / GRID if capacity_pct > 0 else 1.0
        best = np.zeros(GRID + 1)  # best[b]: the largest saving of the sites so far within b cells
        picks = np.zeros((len(sites), GRID + 1), dtype=np.int64)
        for i, opts in enumerate(options):
            new = best.copy()  # option 0 (bf16): no saving, no cost
            for j, (_, p, c) in enumerate(opts[1:], start=1):
                w = 0 if c == 0 else min(GRID + 1, math.ceil(c / cell - 1e-9))
                if w > GRID:
                    continue
                cand = np.full(GRID + 1, -np.inf)
                cand[w:] = best[:GRID + 1 - w] + p
                better = cand > new
                new = np.where(better, cand, new)
                picks[i] = np.where(better, j, picks[i])
            best = new
        b = GRID
        for i in range(len(sites) - 1, -1, -1):  # walk back from the full capacity
            j = int(picks[i, b])
            v, _, c = options[i][j]
            out[sites[i].name] = v
            if j:
                b -= 0 if c == 0 else math.ceil(c / cell - 1e-9)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The fitted scales (what ``loka-tune report`` and MLflow show)."""
        return {"alpha": self.alpha, "beta": self.beta, "n_alpha": self.n_alpha, "n_beta": self.n_beta,
                "unmeasured_error": self.unmeasured_error, "mods_rel_pct": dict(self.mods_rel)}
