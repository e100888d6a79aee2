"""Issue 22: a side collection's statistics as one CUDA graph (``loka_tune.probe.graphs``).

The graph reads and writes the accumulators in place: every state tensor a collection
replaces must be pinned (copied back into the tensor that was there), or a replay would read a
stale one. The CPU checks that, and that pinning changes no statistic; the GPU checks that the
replayed graph gives what eager collections give, layout changes included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from loka_tune.errors import ProbeError
from loka_tune.probe import Probe
from loka_tune.probe.graphs import Pinned, SideGraph, _host_values
from tests.test_probe_compiled import Net, _batches, _step, _tensor_fields


def _state_tensors(probe: Probe) -> dict[str, int]:
    """``id`` of every tensor attribute of every accumulator, its moments and its sketch."""
    out: dict[str, int] = {}
    for name, site in probe._sites.items():
        for part in ("x", "dy"):
            acc = getattr(site, part)
            objs: list[tuple[str, Any]] = [("acc", acc), ("moments", acc.moments)]
            if acc.moments is not None and acc.moments.sketch is not None:
                objs.append(("sketch", acc.moments.sketch))
            for kind, obj in objs:
                for attr, v in vars(obj).items():
                    if isinstance(v, torch.Tensor):
                        out[f"{name}.{part}.{kind}.{attr}"] = id(v)
    return out


def _assert_same_stats(a: Probe, b: Probe, exact: bool = True) -> None:
    fa, fb = _tensor_fields(a.stats), _tensor_fields(b.stats)
    assert fa.keys() == fb.keys()
    for k in fa:
        if fa[k] is None or fb[k] is None:
            assert fa[k] is None and fb[k] is None, k
        elif exact:
            np.testing.assert_array_equal(np.asarray(fb[k]), np.asarray(fa[k]), err_msg=k)
        elif k.endswith(".cov"):
            # a covariance is a GEMM's sum: a captured launch may get another cuBLAS algorithm (another
            # accumulation order) than an eager one, so entries are held to 2e-5 of their scale
            # sqrt(cov_ii cov_jj); the bf16 GEMMs a capture once baked in moved them by ~1.5e-2 of it
            ca, cb = np.asarray(fa[k], float), np.asarray(fb[k], float)
            d = np.sqrt(np.abs(np.diag(ca)))
            np.testing.assert_array_less(np.abs(cb - ca), 2e-5 * np.outer(d, d) + 1e-12, err_msg=k)
        else:
            np.testing.assert_allclose(np.asarray(fb[k], float), np.asarray(fa[k], float), rtol=1e-6, atol=1e-9,
                                       err_msg=k)


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_pinned_collections_keep_every_state_tensor_in_place_and_change_nothing(precision: str) -> None:
    """With the state pinned (what a graph replay needs) a side collection leaves every
    accumulator tensor where it was (its value updated in place): none is missing from the
    probe's list of what a collection replaces. The statistics are exactly the unpinned ones,
    a small sketched stream (``max_full_dim=8``) and a weight fold included."""
    torch.manual_seed(0)
    batches = _batches(4, 256)
    model = Net()
    kw = dict(every=1, step_on="batch", max_full_dim=8, sketch_rank=2, weight_every=2, precision=precision)
    plain, pinned = Probe(model, **kw), Probe(model, **kw)
    pinned._graph = SideGraph(key="another layout", graph=None, inputs=[], outputs=[])  # every collection pinned
    ids = None
    for i, (x, seq, y) in enumerate(batches):
        plain.step(x, seq, target=y)
        pinned.step(x, seq, target=y)
        now = _state_tensors(pinned)
        if ids is not None:
            moved = sorted(k for k in now if now[k] != ids.get(k))
            assert moved == [], f"collection {i + 1} replaced state tensors the graph would not see: {moved}"
        ids = now
    assert pinned.collections == plain.collections == 4
    _assert_same_stats(plain, pinned)


def test_a_layout_fixes_the_host_scalars_a_replay_sets_again() -> None:
    """A graph replay runs no Python: the plain values a collection sets on the state objects
    (an accumulator's ``rows``) are set again from the capture's (``SideGraph.host``). That is
    right only if a collection of the same layout sets the same values; a smaller batch in
    between sets others (the GPU test's 512-row collection), which the next replay undoes."""
    torch.manual_seed(0)
    model = Net()
    probe = Probe(model, every=1, step_on="batch", max_full_dim=8, sketch_rank=2, weight_every=2)

    def host() -> dict[tuple[int, str], Any]:
        sites = list(probe._sites.values())
        return _host_values(list({id(o): o for o, _ in probe._graph_refs(sites)}.values()))

    seen = None
    for i, (x, seq, y) in enumerate(_batches(4, 256)):
        probe.step(x, seq, target=y)
        now = host()
        if seen is not None:
            changed = sorted(k for k, v in now.items() if seen.get(k) != v)
            assert changed == [], f"collection {i + 1} of the same layout set other host values: {changed}"
        seen = now
    x, seq, y = _batches(1, 128, seed=9)[0]
    probe.step(x, seq, target=y)
    assert host() != seen  # another layout: its own rows
    acc = next(iter(probe._sites.values())).x

    class Replay:
        def replay(self) -> None:
            pass

    SideGraph(key="k", graph=Replay(), inputs=[], outputs=[], host=[(acc, "rows", 256)]).run([])
    assert acc.rows == 256


def test_pinned_restores_what_a_failed_update_replaced() -> None:
    class Box:
        def __init__(self) -> None:
            self.t = torch.zeros(3)
            self.out: torch.Tensor | None = None

    box = Box()
    t0 = box.t
    with pytest.raises(RuntimeError, match="half-way"):
        with Pinned([(box, "t"), (box, "out")]):
            box.t, box.out = torch.ones(3), torch.ones(2)
            raise RuntimeError("half-way")
    assert box.t is t0 and torch.equal(t0, torch.zeros(3)) and box.out is None
    with Pinned([(box, "t"), (box, "out")]) as pin:
        box.t, box.out = torch.full((3,), 2.0), torch.ones(2)
    assert box.t is t0 and torch.equal(t0, torch.full((3,), 2.0)) and box.out is not None
    assert pin.old == [t0, None]


def test_graphs_argument_and_note_on_the_cpu() -> None:
    p = Probe(Net(), step_on="batch")
    assert p.graph_note == "eager"  # no CUDA graph on the CPU
    for bad in ("yes", 1):
        with pytest.raises(ProbeError, match="graphs must be True, False or None"):
            Probe(Net(), step_on="batch", graphs=bad)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["auto", "float64"])
def test_side_statistics_replayed_as_a_cuda_graph_equal_the_eager_ones(precision: str) -> None:
    """On a GPU, under bf16 autocast: the side statistics captured at the warm-up and replayed
    at every collection equal an eager probe's (no random draw on either side: every row and
    element kept), through a batch of another size (an eager collection on the graph's state)
    and back to the graph; in the default precision (TF32 products on a GPU) and float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Net().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sizes = [1024] * 4 + [512] + [1024] * 2
    batches = [tuple(t.to(dev) for t in _batches(1, b, seed=i)[0]) for i, b in enumerate(sizes)]
    kw = dict(every=1, step_on="batch", max_rows=1 << 14, real_rows=1 << 14, max_full_dim=8, sketch_rank=2,
              precision=precision)
    graphed, eager = Probe(model, graphs=True, **kw), Probe(model, graphs=False, **kw)
    for x, seq, y in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _step(model, opt, x, seq, y)
            graphed.step(x, seq, target=y)
            eager.step(x, seq, target=y)
    torch.cuda.synchronize()
    # captured at the warm-up, replayed by every collection of 1,024 rows (step 1 collects too)
    assert graphed.graph_note == f"graph ({len(sizes) - 1} replays)", graphed.graph_note
    assert eager.graph_note == "eager"
    _assert_same_stats(eager, graphed, exact=False)


def _emulated_capture(fn: Any, key: Any, inputs: Any, refs: Any, generator: Any) -> SideGraph:
    """:func:`loka_tune.probe.graphs.capture` on the CPU: nothing runs at the capture, each replay
    runs ``fn`` on the static inputs with the state pinned, under the autocast state the capture
    saw (what a CUDA graph bakes in: its kernels are chosen when it is captured)."""
    static = [None if t is None else t.clone() for t in inputs]
    baked, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    class Replay:
        def replay(self) -> None:
            with torch.autocast("cpu", dtype=dtype, enabled=baked), Pinned(refs):
                fn(static)

    return SideGraph(key, Replay(), static, outputs=[])


def test_the_warm_ups_capture_bakes_in_the_statistics_precision_not_the_callers_autocast(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up captures the side statistics after its own collection, outside the one that
    turns the caller's autocast off: a capture made there baked bf16 scatter GEMMs into the
    graph (on the H200 the replayed covariances were up to 40% off the eager probe's on small
    entries, means and variances exact). Emulated on the CPU: the replayed statistics equal the
    eager probe's under bf16 autocast."""
    from loka_tune.probe import collector

    monkeypatch.setattr(collector, "graphs_supported", lambda dev: True)
    monkeypatch.setattr(collector, "capture", _emulated_capture)
    monkeypatch.setattr(Probe, "_wants_warm_up", lambda self: True)
    torch.manual_seed(0)
    model = Net()
    kw = dict(every=1, step_on="batch", max_rows=1 << 14, real_rows=1 << 14, max_full_dim=8, sketch_rank=2,
              precision="float32")
    graphed, eager = Probe(model, graphs=True, **kw), Probe(model, graphs=False, **kw)
    sizes = [512, 512, 256, 512]  # a smaller batch: eager on the graph's state, then the graph again
    for i, b in enumerate(sizes):
        x, seq, y = _batches(1, b, seed=i)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            graphed.step(x, seq, target=y)
            eager.step(x, seq, target=y)
    assert graphed.graph_note == "graph (3 replays)", graphed.graph_note
    _assert_same_stats(eager, graphed, exact=False)


def test_the_statistics_keep_their_precision_under_the_callers_autocast() -> None:
    """A side collection runs inside the training step's autocast (its forward must, to see the
    training's activations); its statistics' products must not: site ``a``'s inputs are the raw
    float32 ``x`` either way, so its float32-product covariance is the same with bf16 autocast on
    (autocast would have made the scatter GEMM a bf16 one: ~1e-2 off)."""
    torch.manual_seed(0)
    model = Net()
    kw = dict(every=1, step_on="batch", precision="float32")
    plain, under = Probe(model, **kw), Probe(model, **kw)
    for x, seq, y in _batches(2, 512):
        plain.step(x, seq, target=y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under.step(x, seq, target=y)
    a, b = plain.stats.sites["a"].x, under.stats.sites["a"].x
    np.testing.assert_allclose(b.cov, a.cov, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(b.var, a.var, rtol=1e-9)
