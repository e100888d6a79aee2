"""The study file's ``[regime]`` table: how the exported config will train in production.

Every timed run of the study (baselines, trials, the confirmation) times its steps exactly
that way, so that a trial's speed-up is the one the user will get. Its keys (``compile``,
``cuda_graphs``, ``batch_size``, ``autocast``, ``nproc``: ``docs/study-schema.md``) override
``[training]``'s ``compile``, ``cuda_graphs``, ``batch_size`` and ``autocast``.
A compiled run keeps at least :data:`COMPILE_WARMUP` warm-up steps out of the step-time
median (compilation is never timed); each compiled run starts from a reset dynamo and reuses
inductor's on-disk graph cache (in ``<output_dir>/inductor_cache``), so trials of one model
recompile cheaply.

``nproc = N`` (N > 1) trains every paired run of the study (the bf16 baselines, every trial,
the confirmation) data-parallel over N processes of this host (one GPU each, gloo on a CPU)
at the same *global* batch: ``loka-tune tune`` re-runs itself under torchrun, rank 0 runs the
study and the other ranks train each run beside it (:mod:`loka_tune.tuner.parallel`). The
batch must split evenly over the N processes; CUDA graphs are one-process only. It is the
alternative to ``--workers N`` (N trials at once, one GPU each); the two do not combine.

The other study-file tables, ``[confirm]`` among them, are in :mod:`loka_tune.tuner.sections`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from loka_tune._toml import Table
from loka_tune.errors import ConfigError

if TYPE_CHECKING:
    from loka_tune.objectives.trainer import TrainConfig

__all__ = ["RegimeSection", "COMPILE_WARMUP"]

COMPILE_WARMUP = 3  # steps: compilation (forward, then backward on the first step) and a settled allocator
_AUTOCASTS = ("auto", "bf16", "off")


@dataclass(frozen=True)
class RegimeSection:
    """How the exported config will train in production: every timed run of the study (baselines,
    trials, the confirmation) times its steps this way, so that a trial's speed-up is the one the
    user will get. Its keys override ``[training]``'s."""

    compile: bool | str = field(default="auto", metadata={
        "doc": "`\"auto\"`: `torch.compile` on CUDA, eager on a CPU; or true / false (compilation is never timed:"
               f" a compiled run keeps at least {COMPILE_WARMUP} warm-up steps out of the step-time median)"})
    cuda_graphs: bool = field(default=False, metadata={
        "doc": "capture each whole step in one CUDA graph (CUDA only, one process only)"})
    batch_size: int = field(default=0, metadata={
        "doc": "the production batch size, the global one with `nproc` > 1 (0: `training.batch_size`)"})
    autocast: str = field(default="", metadata={
        "doc": "`\"auto\"`, `\"bf16\"` or `\"off\"` (`\"\"`: `training.autocast`)", "choices": ("",) + _AUTOCASTS})
    nproc: int = field(default=1, metadata={
        "doc": "processes (GPUs) per training run: every run trains data-parallel over this many processes of"
               " this host at the same global batch, which must split evenly (not with `--workers`)"})

    @classmethod
    def from_table(cls, t: Table, where: Any) -> RegimeSection:
        d = cls()
        comp = t.get("compile", d.compile)
        if comp not in (True, False, "auto"):
            raise ConfigError(f"got {comp!r}; use \"auto\" (compiled on CUDA), true or false", key="regime.compile")
        autocast = t.string("autocast", d.autocast)
        if autocast and autocast not in _AUTOCASTS:
            raise ConfigError(f"got {autocast!r}; choose one of {', '.join(map(repr, _AUTOCASTS))}"
                              " (or leave it out: training.autocast)", key="regime.autocast")
        regime = cls(compile=comp, cuda_graphs=t.boolean("cuda_graphs", d.cuda_graphs),
                     batch_size=t.integer("batch_size", d.batch_size, minimum=0), autocast=autocast,
                     nproc=_nproc(t.get("nproc", d.nproc)))
        if regime.nproc > 1 and regime.cuda_graphs:
            raise ConfigError(f"got nproc = {regime.nproc} with cuda_graphs = true: CUDA graphs are one-process"
                              " only; set cuda_graphs = false or nproc = 1", key="regime.nproc")
        t.done()
        return regime

    def compiled(self, device: str, default: bool = False) -> bool:
        """Whether runs on ``device`` are compiled ("auto": on CUDA; ``default`` elsewhere)."""
        if self.compile == "auto":
            return device.startswith("cuda") or default
        return bool(self.compile)

    def apply(self, tcfg: TrainConfig, device: str | None = None) -> TrainConfig:
        """``tcfg`` in the production regime; ``device``: where it runs (default ``tcfg.device``;
        give the resolved one when that is "auto")."""
        device = device or tcfg.device
        on_cuda = device.startswith("cuda")
        if self.cuda_graphs and not on_cuda:
            raise ConfigError(f"got cuda_graphs = true on device {device!r}: CUDA graphs need a GPU; run"
                              " with --device cuda or set [regime] cuda_graphs = false", key="regime.cuda_graphs")
        comp = self.compiled(device, tcfg.compile)
        out = replace(tcfg, compile=comp, cuda_graphs=self.cuda_graphs or tcfg.cuda_graphs,
                      batch_size=self.batch_size or tcfg.batch_size, autocast=self.autocast or tcfg.autocast)
        if comp and out.warmup_steps < COMPILE_WARMUP:
            out = replace(out, warmup_steps=min(COMPILE_WARMUP, out.steps - 1))
        return out

    def describe(self, tcfg: TrainConfig) -> dict[str, Any]:
        """The regime a run config stands for (for records, provenance and MLflow), with the
        dual-cast mode and form its compiled layers were traced under
        (:mod:`loka_tune.kernels.dualcast`): a run under another cast path is another run."""
        from loka_tune.kernels.dualcast import get_dual_cast, get_dual_cast_op

        return {"compile": tcfg.compile, "cuda_graphs": tcfg.cuda_graphs, "batch_size": tcfg.batch_size,
                "autocast": tcfg.autocast, "device": tcfg.device, "dual_cast": get_dual_cast(),
                "dual_cast_op": get_dual_cast_op()}


def _nproc(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"got {v!r}; expected the number of processes per training run, an integer >= 1"
                          " (at most one per GPU of this host), e.g. nproc = 2", key="regime.nproc")
    return v
