"""Compiled per-site prices of a study's model on one GPU: the cache a study's preparation reads.

For every FP8-eligible Linear of the study's model (sites found on the model with its Mods, at
the batch its ``[regime]`` trains) and every value the study's recipe space would price there
(``--templates``: every recipe variant of TEMPLATES through each backend instead),
:func:`loka_tune.kernels.site_timing.price_sites` times ``Hard Swish -> LokaLinear`` forward +
backward compiled at the site's real (M, K, N) and stores the cells in ``--cache`` (the file
``loka_tune/kernels/data/site_prices_h200.json`` ships in the repo). The receipt ``--out`` has,
per site, each recipe's saving in ms per step, the best one, and the "greedy" config: every site
at its best recipe where it saves at least ``--min-saving-ms`` (a PrecisionConfig with the
study's Mods all on, written to ``--greedy-config`` for ``benchmarks/e2e.py --config``).

    python benchmarks/site_prices.py --study studies/wukong_h200.toml --cache $OUT/site_prices_h200.json \
        --out $OUT/site_prices_receipt.json --greedy-config $OUT/greedy.json --budget 240
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BACKENDS = ("torch_scaled_mm", "fbgemm", "triton")
#: recipe name -> precision template ({b}: the backend); torchao's tensorwise numerics first
TEMPLATES = {
    "tensorwise_fa_fwd": "e4m3.tensor.fa.{b}|e4m3.tensor.{b}|e4m3.tensor.{b}",
    "tensorwise": "e4m3.tensor.{b}",
    "tensorwise_fa": "e4m3.tensor.fa.{b}",
    "rowwise": "e4m3.row.pow2.{b}",
    "rowwise_fa": "e4m3.row.fa.{b}",
    "rowwise_with_gw_hp": "e4m3.row.pow2.{b}|e4m3.row.pow2.{b}|bf16",
    "tensorwise_with_gw_hp": "e4m3.tensor.fa.{b}|e4m3.tensor.{b}|bf16",
}


def site_precs(site: Any, batch: int, backends: tuple[str, ...], device: str) -> dict[str, str]:
    """recipe@backend -> precision string, for the recipes every GEMM of ``site`` supports."""
    from loka_tune.config import ROLES, SitePrecision
    from loka_tune.errors import LokaError
    from loka_tune.kernels import registry

    out: dict[str, str] = {}
    if min(site.in_features, site.out_features) < 16 or site.in_features % 16 or site.out_features % 16:
        return out
    for name, tpl in TEMPLATES.items():
        for b in backends:
            try:
                prec = SitePrecision.parse(tpl.format(b=b))
                be = registry.get_backend(b)
                ok = all(c.is_bf16 or be.supports(c, r, device=device, shape=site.shape(r, batch)) is None
                         for c, r in zip((prec.fwd, prec.dgrad, prec.wgrad), ROLES))
            except (LokaError, KeyError, ValueError):
                continue
            if ok:
                out[f"{name}@{b}"] = prec.short_str()
    return out


def study_recipe_values(cfg: Any, sites: list[Any], batch: int, backends: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Per site, ``"<recipe>.<backend>"`` -> the value the study's recipe space would price there
    (:func:`loka_tune.space.recipe_space.recipe_candidates` on its unpruned per-GEMM space; the
    Dispatch value depends on the probe and is priced by the study itself)."""
    from loka_tune.space.candidates import build_space, enumerate_candidates
    from loka_tune.space.recipe_space import recipe_candidates

    cands = enumerate_candidates(backends, cfg.space.formats, cfg.space.granularities, cfg.space.roundings,
                                 device="cuda")
    space = build_space(sites, cands, batch_size=batch, align=cfg.space.align, min_dim=cfg.space.min_dim,
                        device="cuda")
    rs = recipe_candidates(space, backends)
    return {sc.name: {k: v for k, v in sc.recipes.items() if k != "bf16"} for sc in rs.sites}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=Path("studies/wukong_h200.toml"))
    ap.add_argument("--batch", type=int, default=None, help="default: the study's regime batch")
    ap.add_argument("--backends", default=None, help="default: the study's [space] backends")
    ap.add_argument("--retime", action="store_true", help="time every cell, ignoring the shipped H200 file")
    ap.add_argument("--templates", action="store_true",
                    help="price TEMPLATES (every recipe variant) instead of the study's own recipe values")
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--greedy-config", type=Path, default=None)
    ap.add_argument("--min-saving-ms", type=float, default=0.02)
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds: time no new cell after this")
    args = ap.parse_args(argv)

    from loka_tune.config import ModsConfig, PrecisionConfig
    from loka_tune.data.base import model_inputs
    from loka_tune.kernels.site_timing import SitePriceCache, distinct_cells, price_sites, time_site
    from loka_tune.kernels.timing import environment
    from loka_tune.mods import apply_mods
    from loka_tune.space.sites import discover_sites
    from loka_tune.tuner.build import first_batch, make_model, make_source
    from loka_tune.tuner.study import load_study

    cfg = load_study(args.study)
    batch = args.batch or cfg.batch_size
    source = make_source(cfg)
    model = make_model(cfg, source)
    mods = ModsConfig(no_bias="no_bias" in cfg.space.mods,
                      blocknorm=cfg.space.blocknorm_sizes[0] if "blocknorm" in cfg.space.mods else None,
                      hardswish="hardswish" in cfg.space.mods)
    apply_mods(model, mods)
    sites = discover_sites(model, *model_inputs(model, first_batch(source, cfg, max_rows=64)))
    backends = tuple(b for b in (args.backends or ",".join(cfg.space.backends)).split(",") if b)
    if args.templates:
        names = {s.name: site_precs(s, batch, backends, "cuda") for s in sites}
    else:  # exactly the values the study's recipe space prices (before its probe prunes any GEMM)
        names = study_recipe_values(cfg, sites, batch, backends)
    shapes = {s.name: (s.rows(batch), s.in_features, s.out_features) for s in sites}
    precs = {k: sorted(set(v.values())) for k, v in names.items() if v}
    n_cells = distinct_cells(shapes, precs)
    print(f"{len(sites)} sites, {len(precs)} with FP8 recipes, {n_cells} distinct cells", flush=True)
    # the shipped H200 cells answer what they hold; only the rest is timed (and written to --cache)
    cache = SitePriceCache(args.cache, shipped=() if args.retime else None)
    t0 = time.perf_counter()

    def timer(m: int, k: int, n: int, prec: str, device: str = "cuda") -> dict[str, Any]:
        if time.perf_counter() - t0 > args.budget:
            raise TimeoutError(f"--budget {args.budget:.0f}s spent")
        return time_site(m, k, n, prec, device=device)

    prices = price_sites(shapes, precs, cache=cache, timer=timer, progress=lambda m: print(m, flush=True))
    rows, rules = [], {}
    for s in sites:
        if s.name not in precs:
            continue
        by_recipe = {r: prices[s.name].get(p) for r, p in names[s.name].items()}
        finite = {r: v for r, v in by_recipe.items() if v is not None and v > -1e9}
        best = max(finite, key=lambda r: finite[r]) if finite else None
        rows.append({"site": s.name, "M": shapes[s.name][0], "K": s.in_features, "N": s.out_features,
                     "saving_ms": {r: (None if v is None or v < -1e9 else v * 1e3) for r, v in by_recipe.items()},
                     "best": best, "best_saving_ms": None if best is None else finite[best] * 1e3})
        if best is not None and finite[best] * 1e3 >= args.min_saving_ms:
            rules[s.name] = names[s.name][best]
    env = environment()
    receipt = {"meta": {"device": env["device"], "versions": env, "python": platform.python_version(),
                        "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "batch": batch,
                        "mods": mods.to_dict(), "cells": n_cells, "wall_s": time.perf_counter() - t0,
                        "method": "Hard Swish -> LokaLinear fwd + bwd, torch.compile(fullgraph=True), bf16"
                                  " autocast; GPU busy time from torch.profiler; saving = GPU time saved"
                                  " minus host time added"},
               "rows": rows, "greedy": rules,
               "greedy_saving_ms": sum(r["best_saving_ms"] for r in rows
                                       if r["best"] is not None and r["site"] in rules)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(receipt, indent=1))
    if args.greedy_config is not None:
        PrecisionConfig.from_sites(rules, mods=mods).save(args.greedy_config)
    for r in rows:
        print(f"{r['site']:28s} {r['M']:>8d}x{r['K']:<6d}x{r['N']:<6d} best {r['best']} "
              f"{r['best_saving_ms'] if r['best_saving_ms'] is None else round(r['best_saving_ms'], 3)} ms")
    print(f"greedy: {len(rules)} sites, {receipt['greedy_saving_ms']:.3f} ms saved per step (additive)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
