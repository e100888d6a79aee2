"""The bf16 baseline: the reference every trial pairs with, and its noise floor.

bf16 short runs on every ``training.seeds`` (the Probe watching the first) give the baseline's
quality; beside each, a *twin*: the same run (seed, data order, regime) from initial weights
perturbed at bf16's rounding scale (:func:`perturb_weights`). A trial is paired with its
seed's baseline, so the noise its relative log loss carries is what such a benign change
moves the result by, not the distance between two seeds: the noise floor is the largest
|relative log loss| of a twin against its own seed's baseline (:func:`paired_noise_floor`).
The seed-to-seed distance is kept as information. :func:`price_baseline` states the
baseline's speed in the objective's terms (measured, or modeled GEMMs + a non-GEMM remainder).
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loka_tune.config import ModsConfig, PrecisionConfig
from loka_tune.errors import StudyError
from loka_tune.objectives.speed import measure_forward_seconds, modeled_gemm_seconds
from loka_tune.objectives.trainer import phases_note
from loka_tune.tuner.build import first_batch, make_model, train_config
from loka_tune.tuner.log import log
from loka_tune.tuner.parallel import train_in_study
from loka_tune.tuner.study import StudyConfig

__all__ = ["Baseline", "run_baseline", "check_budget", "price_baseline", "modeled_seconds", "time_reference",
           "perturb_weights", "paired_noise_floor", "NOISE_EPS", "NOISE_PERTURBATION"]

REFERENCE_TIMED_STEPS = 50  # timed steps of a bf16 (+ Mods) reference run: a median of 50 is stable to ~1%

#: The noise twin's perturbation: the weight W of every nn.Linear (the tensors FP8 would round)
#: becomes W * (1 + NOISE_EPS * Z), Z ~ N(0, 1) elementwise, drawn on the CPU from the seed (the
#: same bits on every device). 2^-8 is bf16's unit roundoff: about one bf16 rounding of each
#: weight, once. FP8 dwarfs it: e4m3 rounds these weights to 2^-4 (e5m2 2^-3), 16-32x coarser,
#: and their activations and gradients too, at every step (on the quickstart, the 2048x2048
#: layer's output is about 44 dB from the unperturbed model's in a twin, 20-29 dB under FP8).
#: By the end of a short run the two effects can be of one size (training amplifies any
#: change): that is the noise a paired difference carries. Initial weights rather than inputs
#: or steps: a change the trainer never sees (no trainer code, any regime, compiled or not),
#: explicit and device-independent, so a deterministic CPU run gets a non-zero, computed floor;
#: on a GPU the twin's own nondeterminism (atomics, compiled kernels) adds to it, as it does to
#: every trial. A model without an nn.Linear gets every floating-point parameter perturbed.
NOISE_EPS = 2.0 ** -8
NOISE_PERTURBATION = "initial Linear weights x (1 + 2^-8 N(0,1))"


@dataclass(frozen=True)
class Baseline:
    """What the bf16 baseline runs measured: the reference of every trial.

    ``eval_logloss[i]`` is seed ``seeds[i]``'s; trials pair with ``seeds[0]``.
    ``noise_floor_pct``: what the budget is checked against and "within noise" means, of kind
    ``noise_floor_kind``: ``"paired"``, the largest |``paired_noise_pct``|; ``"seeds"`` (a
    baseline stored before twins existed), the seed-to-seed distance.
    ``paired_logloss`` / ``paired_noise_pct``: the noise twins (``[objective] noise_twins`` per
    seed, seed by seed in ``seeds`` order; a twin is its seed's baseline run from perturbed
    initial weights, :data:`NOISE_PERTURBATION`): each one's eval log loss and its relative log
    loss vs its seed's baseline, in percent.
    ``seed_spread_pct``: the largest |relative log loss| between another seed's baseline and
    seeds[0]'s (information: trials are paired, so it is not their noise; None with one seed).
    ``window_losses``: seeds[0]'s training loss curve (the pruner compares against it).
    ``step_time_s``: the objective's bf16 value (measured, or modeled GEMMs + remainder).
    """

    seeds: tuple[int, ...]
    eval_logloss: tuple[float, ...]
    eval_ne: float
    eval_auc: float
    window_losses: tuple[float, ...]
    window_steps: tuple[int, ...]
    noise_floor_pct: float
    step_time_s: float
    speed_source: str
    measured_step_time_s: float
    gemm_bf16_s: float = 0.0
    remainder_s: float = 0.0
    device: str = "cpu"
    paired_logloss: tuple[float, ...] = ()
    paired_noise_pct: tuple[float, ...] = ()
    seed_spread_pct: float | None = None
    noise_floor_kind: str = "paired"

    @property
    def logloss(self) -> float:
        return self.eval_logloss[0]

    def noise_floor_what(self) -> str:
        """What the noise floor is, in words (the refusal, ``tune`` and ``report`` say it)."""
        if self.noise_floor_kind == "seeds":
            return f"relative log loss between bf16 baseline seeds {list(self.seeds)}, stored before paired floors"
        spread = "" if self.seed_spread_pct is None else f"; seed to seed: {self.seed_spread_pct:.3g}%"
        return (f"paired: the largest |relative log loss| of a bf16 twin ({NOISE_PERTURBATION}) vs its own"
                f" seed's baseline, seeds {list(self.seeds)}{spread}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Baseline:
        d = dict(d)
        for k in ("seeds", "eval_logloss", "window_losses", "window_steps", "paired_logloss", "paired_noise_pct"):
            if k in d:
                d[k] = tuple(d[k])
        if "noise_floor_kind" not in d:  # stored before noise twins: its floor is the seed-to-seed distance
            d["noise_floor_kind"] = "seeds"
            d.setdefault("seed_spread_pct", d.get("noise_floor_pct"))
        return cls(**d)


def perturb_weights(model: nn.Module, seed: int, *, twin: int = 0, eps: float = NOISE_EPS) -> nn.Module:
    """Multiply the weight of every ``nn.Linear`` of ``model`` (every floating-point parameter
    if it has none) by ``1 + eps * z``, ``z ~ N(0, 1)``, in place: the init of seed ``seed``'s
    noise twin number ``twin`` (:data:`NOISE_EPS`). ``z`` is drawn on the CPU from ``(seed,
    twin)``, tensor by tensor in module order: the same perturbation on every device and in
    every process. Returns ``model``."""
    from loka_tune.data.hashing import mix_seed

    gen = torch.Generator(device="cpu").manual_seed(mix_seed(seed, "noise-twin", twin))
    params = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    if not params:
        params = [p for p in model.parameters() if p.is_floating_point()]
    with torch.no_grad():
        for p in params:
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.mul_(z.mul_(eps).add_(1.0).to(device=p.device, dtype=p.dtype))  # 1 + eps z in place: the same bits
    return model


def paired_noise_floor(paired_noise_pct: Sequence[float]) -> float:
    """The paired noise floor, in percent: the largest |relative log loss| of a noise twin vs
    its own seed's baseline (over every twin of every seed). A trial's relative log loss within
    this of zero cannot be told from the effect of one bf16 rounding of the initial weights."""
    return max((abs(float(x)) for x in paired_noise_pct), default=0.0)


def _say_progress(label: str, total: int) -> Callable[[int, float], None]:
    """A progress callback printing a line at every quarter of the run (no silent minutes)."""
    marks = sorted({max(1, round(total * q / 4)) for q in (1, 2, 3)})
    t0 = time.perf_counter()

    def say(step: int, loss: float) -> None:  # called every log_every steps
        if marks and step >= marks[0] and step < total:
            while marks and step >= marks[0]:
                marks.pop(0)
            log(f"[loka-tune]   {label}: step {step}/{total}, train loss {loss:.4f}"
                 f" ({time.perf_counter() - t0:.0f}s)")

    return say


def run_baseline(cfg: StudyConfig, source: Any, device: str, *, force: bool = False,
                 probe_out: Path | None = None,
                 on_run: Callable[[int, Any], None] | None = None,
                 with_stats: Callable[[Any], None] | None = None,
                 beside_twin: bool = False) -> tuple[Baseline, Any, nn.Module]:
    """bf16 short runs on every seed (the Probe watching the first), each followed by its
    noise twin (the same run from perturbed initial weights: :func:`perturb_weights`); returns
    the baseline, the probe's statistics (or None) and the first seed's trained model.
    ``on_run(seed, result)`` sees each baseline run's
    :class:`~loka_tune.objectives.trainer.TrainResult` (its per-step losses go to MLflow).

    ``with_stats(stats)``: work on the probe's statistics (the study's probe measurement), done
    before this returns, its error raised here. ``beside_twin`` (a GPU, where the twin's steps
    leave the host waiting): the statistics are read back and ``with_stats`` runs in a thread
    while the probed seed's twins train (:class:`_Beside`), the twins' step times then left out
    of the bf16 step time (the work beside them shares their GPU); otherwise one after the
    other, the twins first. Neither the probe's read-back nor its measurement draws on a global
    random generator, times a kernel or changes a global setting, so the twins train and the
    statistics read as they would alone (``tests/test_prepare_beside.py``).

    Every run is in the study's ``[regime]``, the probed one included: on a compiled or
    CUDA-graph regime the probe collects from a sub-batch of the step's batch on the uncompiled
    module after the step (:func:`_probed_run`), so the compiled graph is never re-guarded. The
    twins (``[objective] noise_twins`` per seed) run in the regime, as trials do, and pair with
    their seed's baseline as trials pair with seeds[0]'s. The bf16 step time is the median of
    every run's median step (the probed run's steps are timed without its collections, which
    run outside the step's timing), twins included.
    """
    from loka_tune.applier import apply
    from loka_tune.objectives.metrics import relative_log_loss

    bf16 = PrecisionConfig()
    results, regime_times, twins, paired = [], [], [], []
    stats = None
    first_model: nn.Module | None = None
    beside: _Beside | None = None  # the probe's read-back and with_stats, in a thread beside the twins
    read: Callable[[], Any] | None = None  # the same, here, after the twins
    spent = dict.fromkeys(("runs", "twins", "builds", "probe"), 0.0)  # where the baselines' seconds went
    t_all = time.perf_counter()
    for i, seed in enumerate(cfg.training.seeds):
        t_build = time.perf_counter()
        model = make_model(cfg, source, seed=seed)
        apply(model, bf16)
        spent["builds"] += time.perf_counter() - t_build
        tcfg = train_config(cfg, seed, device=device)
        t0 = time.perf_counter()
        probed = i == 0 and cfg.probe.enabled
        what = f"probe every {cfg.probe.every} steps, " if probed else ""
        log(f"[loka-tune] baseline seed {seed} (bf16, {what}{_regime_str(tcfg)}): {tcfg.steps} steps ...")
        say = _say_progress(f"baseline seed {seed}", tcfg.steps)
        if probed:
            res, probe, note = _probed_run(cfg, model, source, tcfg, seed, say)
            read = _reader(probe, note, probe_out, with_stats, beside_twin)
            if beside_twin:
                beside = _Beside(read, device)
                read = None
            regime_times.append(float(res.step_time_s))  # in the regime; collections are outside its timing
        else:
            res = train_in_study(model, source, tcfg, seed=seed, config=bf16, progress=say)
            regime_times.append(float(res.step_time_s))
        spent["runs"] += time.perf_counter() - t0
        if i == 0:
            first_model = model
        if res.status != "ok":
            raise StudyError(f"the bf16 baseline (seed {seed}) did not finish: status {res.status!r}"
                             f" (non-finite step {res.nonfinite_step}); lower training.lr_dense/lr_sparse")
        log(f"[loka-tune] baseline seed {seed}: eval log loss {res.eval_logloss:.5f}, NE {res.eval_ne:.4f},"
             f" AUC {res.eval_auc:.4f} ({_took(t0, res)}: {_run_note(res, tcfg)})")
        results.append(res)
        if on_run is not None:
            on_run(seed, res)
        for k in range(cfg.objective.noise_twins):
            twin, twin_build_s, twin_run_s = _noise_twin(
                cfg, source, tcfg, seed, k, float(res.eval_logloss),
                beside="; the probe's read-back and measurement beside it" if beside else "")
            spent["builds"] += twin_build_s
            spent["twins"] += twin_run_s
            twins.append(float(twin.eval_logloss))
            paired.append(relative_log_loss(twin.eval_logloss, res.eval_logloss) * 100)
            if beside is None:  # beside the probe's work it shares the GPU: its step time is not bf16's alone
                regime_times.append(float(twin.step_time_s))
        t_probe = time.perf_counter()
        if beside is not None:
            stats = beside.result()
            beside = None
        elif read is not None:
            stats = read()
            read = None
        spent["probe"] += time.perf_counter() - t_probe
    lls = tuple(float(r.eval_logloss) for r in results)
    spread = max([abs(relative_log_loss(ll, lls[0])) * 100 for ll in lls[1:]], default=None)
    floor = paired_noise_floor(paired)
    r0 = results[0]
    step_s = float(statistics.median(regime_times))
    bl = Baseline(seeds=tuple(cfg.training.seeds), eval_logloss=lls, eval_ne=float(r0.eval_ne),
                  eval_auc=float(r0.eval_auc), window_losses=tuple(float(x) for x in r0.loss_curve),
                  window_steps=tuple(int(s) for s in r0.curve_steps), noise_floor_pct=float(floor),
                  step_time_s=step_s, speed_source="measured",
                  measured_step_time_s=step_s, device=str(r0.device), paired_logloss=tuple(twins),
                  paired_noise_pct=tuple(float(x) for x in paired),
                  seed_spread_pct=None if spread is None else float(spread), noise_floor_kind="paired")
    n = cfg.objective.noise_twins
    per_seed = ", ".join(f"seed {s}: " + " ".join(f"{x:+.3g}%" for x in paired[i * n:(i + 1) * n])
                         for i, s in enumerate(bl.seeds))
    log(f"[loka-tune] noise floor {floor:.3g}% (paired: the largest |rel. log loss| of a twin vs its seed's"
         f" baseline; {per_seed})"
         + ("" if spread is None else f"; seed to seed {spread:.3g}% (information only: trials are paired)"))
    log(_spent_note(time.perf_counter() - t_all, spent))
    assert first_model is not None
    return bl, stats, first_model


def _probed_run(cfg: StudyConfig, model: nn.Module, source: Any, tcfg: Any, seed: int,
                progress: Callable[[int, float], None]) -> tuple[Any, Any, str]:
    """The probed baseline run, in the regime: ``(TrainResult, Probe, note)``, the probe detached
    and its statistics not yet read back (:func:`_reader`); ``note`` says where its collections'
    time went, for the read-back's log line.

    A compiled or CUDA-graph regime gets ``Probe(step_on="batch")``: after each step the
    trainer hands it the step's batch (under the run's autocast), and a collection step runs
    the probe's own forward and backward of a random sub-batch (2,048 examples on a GPU, the
    whole batch on the CPU) on the uncompiled module, so the compiled graph never sees a hook
    and is never re-guarded. An eager regime keeps the in-step probe (``step_on="manual"``: the
    hooks of the collection's own training forward). Either way training is what it is
    without the probe, and the collection runs outside the step's timing (``on_batch`` /
    ``after_step`` come after the timed step), so the run's median step time is the regime's.
    """
    from loka_tune.data.base import model_inputs
    from loka_tune.probe import Probe

    every = cfg.probe.every
    if tcfg.compile or tcfg.cuda_graphs:
        probe = Probe(model, every=every, step_on="batch")
        side_s: list[float] = []  # host seconds of each step's hand-off (collection steps: their forward + backward)

        def side(_n: int, batch: Any) -> None:
            t = time.perf_counter()
            probe.step(*model_inputs(model, batch), target=batch.labels)
            side_s.append(time.perf_counter() - t)

        t_in = time.perf_counter()
        # the compiler's import, timed apart from the rest: dynamo's (strict_compile's first
        # import), then inductor's (torch.compile's first call would import it)
        if tcfg.compile:
            import torch._dynamo  # noqa: F401
        t_dynamo = time.perf_counter()
        if tcfg.compile:
            import torch._inductor.compile_fx  # noqa: F401
        t_imported = time.perf_counter()
        with probe:
            res = train_in_study(model, source, tcfg, seed=seed, config=PrecisionConfig(), on_batch=side, progress=progress)
        t = time.perf_counter()
        imports = t_imported - t_in
        rest = max(t - t_imported - float(res.wall_s), 0.0)
        return res, probe, (f"{probe.collections} side collection(s) ({_side_note(side_s)}); their statistics ran"
                            f" {probe.graph_note}; outside its run {imports + rest:.1f}s (the compiler's import"
                            f" {imports:.1f}s: dynamo {t_dynamo - t_in:.1f}s, inductor {t_imported - t_dynamo:.1f}s;"
                            f" attach, strict_compile and exit {rest:.1f}s)")
    with Probe(model, every=every, step_on="manual") as probe:
        res = train_in_study(model, source, tcfg, seed=seed, config=PrecisionConfig(), after_step=lambda _n: probe.step(),
                     progress=progress)
    return res, probe, f"{probe.collections} collection(s) in the steps"


def _reader(probe: Any, note: str, out: Path | None, with_stats: Callable[[Any], None] | None,
            beside: bool) -> Callable[[], Any]:
    """The probe's read-back (the snapshot: every site's statistics and weight model read back
    to the host), its file (``out``) and ``with_stats``, as one call returning the statistics."""

    def read() -> Any:
        t = time.perf_counter()
        stats = probe.stats
        where = " beside the noise twin" if beside else ""
        log(f"[loka-tune] probe: {note}; read back in {time.perf_counter() - t:.1f}s{where}")
        if out is not None:
            stats.save(out)
        if with_stats is not None:
            with_stats(stats)
        return stats

    return read


class _Beside:
    """``fn()`` in a daemon thread from now; :meth:`result` waits for it and returns its value or
    raises its error. A daemon: an interrupted study does not wait for it to end.

    On a CUDA ``device`` the thread queues its work on a stream of its own, which first waits
    for what the caller had queued (the probed run's last kernels): on the caller's stream each
    of its host reads would wait behind the twin's queued steps (on an H100, with the twin's
    steps on the same stream, the probe's read-back took 5.1 s and its measurement 12.5 s beside
    a 12.1 s twin; 3.4 s and 5.2 s alone on the H200). Its kernels then run beside the twin's,
    and the thread waits for its stream before it ends, so nothing it read is freed early."""

    def __init__(self, fn: Callable[[], Any], device: str | torch.device = "cpu") -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        dev = torch.device(device)
        stream = None
        if dev.type == "cuda":
            stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(dev))  # before the caller queues anything more

        def run() -> None:
            try:
                if stream is None:
                    self._value = fn()
                else:
                    try:
                        with torch.cuda.stream(stream):
                            self._value = fn()
                    finally:
                        stream.synchronize()
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread by result()
                self._error = e

        self._thread = threading.Thread(target=run, name="loka-probe-beside-twin", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _side_note(side_s: Sequence[float]) -> str:
    """``"2.9s in the steps, the slowest 2.1s"``: where the probe's hand-offs spent their time
    (host seconds, not synchronised: a collection's kernels finish inside the next timed step's)."""
    if not side_s:
        return "no hand-off"
    return f"{sum(side_s):.1f}s in the steps, the slowest {max(side_s):.1f}s"


def _noise_twin(cfg: StudyConfig, source: Any, tcfg: Any, seed: int, twin: int, base_logloss: float,
                beside: str = "") -> tuple[Any, float, float]:
    """Seed ``seed``'s noise twin number ``twin``: its bf16 baseline run again in the regime
    (``tcfg``), from initial weights perturbed by :func:`perturb_weights`; returns its
    TrainResult, the seconds its model's build and perturbation took and those of its run. With ``[regime]
    nproc > 1`` the other ranks build the unperturbed model and DDP's initial broadcast gives
    them rank 0's."""
    from loka_tune.applier import apply
    from loka_tune.objectives.metrics import relative_log_loss

    bf16 = PrecisionConfig()
    t_build = time.perf_counter()
    model = perturb_weights(make_model(cfg, source, seed=seed), seed, twin=twin)
    apply(model, bf16)
    t0 = time.perf_counter()
    what = f"noise twin {twin + 1} of seed {seed}"
    log(f"[loka-tune] {what} (bf16, {NOISE_PERTURBATION}, {_regime_str(tcfg)}{beside}): {tcfg.steps} steps ...")
    res = train_in_study(model, source, tcfg, seed=seed, config=bf16, progress=_say_progress(what, tcfg.steps))
    if res.status != "ok":
        raise StudyError(f"the {what} (its bf16 baseline from perturbed initial weights) did not finish: status"
                         f" {res.status!r} (non-finite step {res.nonfinite_step}): the runs are unstable; lower"
                         " training.lr_dense/lr_sparse")
    log(f"[loka-tune] {what}: eval log loss {res.eval_logloss:.5f}"
         f" ({relative_log_loss(res.eval_logloss, base_logloss) * 100:+.4f}% vs its baseline,"
         f" {_took(t0, res)}: {_run_note(res, tcfg)})")
    return res, t0 - t_build, time.perf_counter() - t0


def _spent_note(total: float, spent: Mapping[str, float]) -> str:
    """Where the baselines' ``total`` seconds went: ``spent`` holds the baseline runs' (their
    probe attach, compiler import and logging included), the noise twins', the model builds'
    (the twins' perturbation included) and the wait on the probe's read-back and measurement
    after the twins (all of it where they do not run beside a twin); the rest is what none of
    them holds (``on_run``: the runs' MLflow logging)."""
    rest = max(total - sum(spent.values()), 0.0)
    return (f"[loka-tune] baselines {total:.1f}s: baseline runs {spent['runs']:.1f}s, noise twins"
            f" {spent['twins']:.1f}s, model builds {spent['builds']:.1f}s, the probe's work after the twins"
            f" {spent['probe']:.1f}s, the rest {rest:.1f}s")


def _took(t0: float, res: Any) -> str:
    """``"40.3s"``: the seconds since ``t0``; where over half a second of them lay outside the
    trainer's own phases (before its setup or after its eval: the process's first compiled run
    imports inductor, the probe's statistics are read back), ``"40.3s, 8.3s of it outside the run"``."""
    took = time.perf_counter() - t0
    wall = getattr(res, "wall_s", None)
    outside = took - float(wall) if isinstance(wall, (int, float)) and wall == wall else 0.0
    return f"{took:.1f}s" + (f", {outside:.1f}s of it outside the run" if outside > 0.5 else "")


def _run_note(res: Any, tcfg: Any) -> str:
    """Where a baseline or twin run's time went (:func:`phases_note`) and, for a compiled run in
    this process, how its graphs were had (inductor's FX graph cache, AOTAutograd's): read right
    after the run, dynamo's counters are that run's (``strict_compile`` clears them as it starts)."""
    note = phases_note(res)
    if not tcfg.compile:
        return note
    from loka_tune.objectives.compiled import compile_cache_counts

    c = compile_cache_counts()
    return (f"{note}; graphs: {c['hits']} from inductor's cache, {c['misses']} compiled, AOT"
            f" {c['aot_hits']} hit / {c['aot_misses']} miss / {c['aot_bypass']} bypassed")


def _regime_str(tcfg: Any) -> str:
    return (f"{'compiled' if tcfg.compile else 'eager'}{' + CUDA graphs' if tcfg.cuda_graphs else ''},"
            f" batch {tcfg.batch_size}")


def time_reference(cfg: StudyConfig, source: Any, device: str, mods: ModsConfig, *, seed: int | None = None) -> float:
    """Measured step seconds of bf16 with ``mods`` in the study's regime: a run of the warm-up
    plus up to :data:`REFERENCE_TIMED_STEPS` timed steps (its loss is not needed)."""
    from loka_tune.applier import apply

    model = make_model(cfg, source, seed=seed)
    config = PrecisionConfig(mods=mods)
    apply(model, config)
    tcfg = train_config(cfg, seed, device=device)
    steps = min(tcfg.steps, tcfg.warmup_steps + REFERENCE_TIMED_STEPS)
    tcfg = replace(tcfg, steps=steps, window=min(tcfg.window, steps), eval_batches=1)
    res = train_in_study(model, source, tcfg, seed=seed, config=config)
    return float(res.step_time_s)


def check_budget(cfg: StudyConfig, baseline: Baseline, *, force: bool) -> None:
    """Refuse (unless ``force``) a budget below the baseline's noise floor: the message says how
    big the floor is, what it measures, and which settings move it."""
    b, floor = cfg.objective.budget_pct, baseline.noise_floor_pct
    if baseline.noise_floor_kind == "seeds" and len(baseline.seeds) < 2:  # an old one-seed baseline
        warnings.warn("one baseline seed: the noise floor is unknown; run the study again with --fresh"
                      " for a paired floor", stacklevel=2)
        return
    if b < floor:
        msg = (f"objective.budget_pct = {b}% is below the noise floor {floor:.4g}% ({baseline.noise_floor_what()}):"
               " a trial's relative log loss cannot be told apart from noise. Raise objective.budget_pct above"
               f" {floor:.3g}%, or make the short runs less noisy: a larger training.batch_size lowers the floor"
               " most (more training.steps can raise it: a change has longer to grow); a lower"
               f" training.lr_dense (now {cfg.training.lr_dense:g}) with training.lr_cooldown_steps calms runs"
               " that drift early; objective.noise_twins > 1 measures it more steadily. Or pass --force")
        if not force:
            raise StudyError(msg)
        warnings.warn(msg + " (forced)", stacklevel=2)


def price_baseline(cfg: StudyConfig, baseline: Baseline, source: Any, batch: Any, *, speed: str,
                   device: str) -> Baseline:
    """The baseline's step time in the objective's terms: modeled (the bf16 GEMMs from the cost
    model + ``objective.non_gemm_fraction`` of the step for the rest), a measured forward pass
    (the inference objective), or as the training run measured it."""
    from loka_tune.applier import apply

    if speed == "modeled":
        bf16_model = make_model(cfg, source)
        apply(bf16_model, PrecisionConfig())
        gemm = modeled_gemm_seconds(bf16_model, batch, batch_size=cfg.batch_size,
                                    cost_batch_size=cfg.cost_batch_size, device=cfg.objective.cost_device,
                                    kind=cfg.objective.kind)
        f = cfg.objective.non_gemm_fraction
        remainder = gemm * f / (1.0 - f)
        return replace(baseline, speed_source="modeled", gemm_bf16_s=gemm, remainder_s=remainder,
                       step_time_s=gemm + remainder)
    if cfg.objective.kind == "inference":
        m = make_model(cfg, source).to(device)
        apply(m, PrecisionConfig())
        t = measure_forward_seconds(m, first_batch(source, cfg, device), autocast=cfg.training.autocast)
        return replace(baseline, step_time_s=t)
    return baseline


def modeled_seconds(model: nn.Module, batch: Any, cfg: StudyConfig, baseline: Baseline) -> float:
    """Modeled step (or forward) seconds: GEMMs from the cost model + the baseline's non-GEMM remainder."""
    g = modeled_gemm_seconds(model, batch, batch_size=cfg.batch_size,
                             cost_batch_size=cfg.cost_batch_size, device=cfg.objective.cost_device,
                             kind=cfg.objective.kind)
    return g + baseline.remainder_s
