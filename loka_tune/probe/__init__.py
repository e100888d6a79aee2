"""The LoKA Probe: know where low precision is safe and fast.

Online (:mod:`~loka_tune.probe.collector`): :class:`Probe` hooks every eligible linear of a
model during real training and keeps cheap statistics every ``every`` steps (feature mean and
covariance of inputs and output gradients, merged in float64; a matrix-normal model of each
weight). Offline (:mod:`~loka_tune.probe.measure`): :func:`measure` draws synthetic operands
from those statistics and measures, per site x GEMM role x candidate choice, the error
against a float64 reference and the speed (measured or modeled), giving a
:class:`ProbeReport` of safe / unsafe and fast / slow cells.

>>> with Probe(model, every=100) as p:              # doctest: +SKIP
...     train(model, source, cfg)
>>> report = measure(p.stats, ["e4m3.row.emulated"], samples=64)   # doctest: +SKIP
>>> print(report.table()); report.heatmap("probe.png")             # doctest: +SKIP
"""

from __future__ import annotations

from loka_tune.probe.collector import Probe
from loka_tune.probe.measure import DEFAULT_CANDIDATES, DEFAULT_MAX_ERROR, measure
from loka_tune.probe.report import ProbeReport
from loka_tune.probe.run import collect, run_probe
from loka_tune.probe.stats import ProbeStats

# what a user calls; the other names imported above are importable but internal (they may change)
__all__ = [
    "Probe",
    "measure",
    "run_probe",
    "collect",
    "ProbeReport",
    "ProbeStats",
    "DEFAULT_CANDIDATES",
    "DEFAULT_MAX_ERROR",
]
