"""Mods as search dimensions of the tuner: the options of each Mod and the way back to a config.

>>> mod_choices()["blocknorm"]
[None, 64, 128, 256]
>>> mods_from_params({"mods.no_bias": True, "mods.blocknorm": 128, "site.x": "bf16"}).short_str()
'nobias+bn128'
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from loka_tune.config import ModsConfig
from loka_tune.errors import ConfigError

__all__ = ["MOD_NAMES", "PARAM_PREFIX", "mod_choices", "mods_from_params", "mods_to_params"]

MOD_NAMES: tuple[str, ...] = ("no_bias", "blocknorm", "hardswish", "pad", "fuse_epilogue", "fp8_chain")
PARAM_PREFIX = "mods."


def mod_choices(
    *,
    blocknorm: Sequence[int] = (64, 128, 256),
    pad: Sequence[int] = (16,),
    include: Sequence[str] = MOD_NAMES,
) -> dict[str, list]:
    """Each Mod's options as an Optuna categorical list (``None`` / ``False`` = off, first).

    Default: ``{"no_bias": [False, True], "blocknorm": [None, 64, 128, 256],
    "hardswish": [False, True], "pad": [None, 16], "fuse_epilogue": [False, True]}``.
    ``include`` restricts the Mods searched (the others stay off: :func:`mods_from_params`
    defaults them). ``fuse_epilogue`` (run Linear -> BlockNorm -> Hard Swish as one fused FP8
    GEMM epilogue, see :class:`~loka_tune.config.ModsConfig`) changes something only when
    ``blocknorm`` and ``hardswish`` are on too; ``fp8_chain`` (MLPs of tensorwise FP8 sites as one
    chain whose norms write the FP8 operands) only with ``no_bias``, ``blocknorm = 256`` and
    ``hardswish`` (:func:`mods_from_params` turns it off otherwise).
    """
    unknown = [n for n in include if n not in MOD_NAMES]
    if unknown:
        raise ConfigError(f"unknown Mod(s) {unknown}; the Mods are {list(MOD_NAMES)}", key="mods")
    for key, sizes in (("blocknorm", blocknorm), ("pad", pad)):
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
                raise ConfigError(f"got {s!r}; {key} options are positive integers", key=f"mods.{key}")
    full: dict[str, list] = {
        "no_bias": [False, True],
        "blocknorm": [None, *dict.fromkeys(blocknorm)],
        "hardswish": [False, True],
        "pad": [None, *dict.fromkeys(pad)],
        "fuse_epilogue": [False, True],
        "fp8_chain": [False, True],
    }
    return {n: full[n] for n in MOD_NAMES if n in include}


def _as_bool(v: Any, key: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    raise ConfigError(f"got {v!r}; expected true or false", key=key)


def _as_size(v: Any, key: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, str):
        t = v.strip().lower()
        if t in ("none", "null", "off", ""):
            return None
        if t.isdigit():
            v = int(t)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"got {v!r}; expected a positive integer or None (off)", key=key)
    return v


def mods_from_params(params: Mapping[str, Any], *, keep_bias: Sequence[str] = ()) -> ModsConfig:
    """The :class:`ModsConfig` encoded in a trial's parameters.

    Reads ``no_bias`` / ``blocknorm`` / ``hardswish`` / ``pad`` / ``fuse_epilogue`` / ``fp8_chain`` either bare or prefixed with
    ``"mods."``; other keys (the sites' choices) are ignored; a Mod absent from ``params`` is
    off. Values may also be the strings MLflow stores (``"True"``, ``"None"``, ``"128"``).
    An unknown ``"mods.*"`` key raises :class:`ConfigError`.
    """
    if not isinstance(params, Mapping):
        raise ConfigError(f"got {type(params).__name__}; expected a mapping of parameter names to values", key="params")
    found: dict[str, Any] = {}
    for key, value in params.items():
        if not isinstance(key, str):
            continue
        name = key[len(PARAM_PREFIX):] if key.startswith(PARAM_PREFIX) else key
        if name in MOD_NAMES:
            if name in found:
                raise ConfigError(f"given twice (bare and with the {PARAM_PREFIX!r} prefix)", key=key)
            found[name] = value
        elif key.startswith(PARAM_PREFIX):
            raise ConfigError(f"unknown Mod {name!r}; the Mods are {list(MOD_NAMES)}", key=key)
    no_bias = _as_bool(found.get("no_bias", False), "mods.no_bias")
    blocknorm = _as_size(found.get("blocknorm"), "mods.blocknorm")
    hardswish = _as_bool(found.get("hardswish", False), "mods.hardswish")
    fuse = _as_bool(found.get("fuse_epilogue", False), "mods.fuse_epilogue")
    # fp8_chain only where its blocks exist (bias-free Linear -> BlockNorm(256) -> Hard Swish), and
    # then in place of fuse_epilogue (both take those blocks): a sampled combination that has no
    # chain decodes to the same config (and trial cache key) as the trial without it
    chain = _as_bool(found.get("fp8_chain", False), "mods.fp8_chain") and no_bias and blocknorm == 256 and hardswish
    return ModsConfig(
        no_bias=no_bias,
        keep_bias=tuple(keep_bias),
        blocknorm=blocknorm,
        hardswish=hardswish,
        pad=_as_size(found.get("pad"), "mods.pad"),
        fuse_epilogue=fuse and not chain,
        fp8_chain=chain,
    )


def mods_to_params(mods: ModsConfig, *, prefix: str = PARAM_PREFIX) -> dict[str, Any]:
    """The inverse of :func:`mods_from_params` (e.g. to enqueue a known trial)."""
    return {
        f"{prefix}no_bias": mods.no_bias,
        f"{prefix}blocknorm": mods.blocknorm,
        f"{prefix}hardswish": mods.hardswish,
        f"{prefix}pad": mods.pad,
        f"{prefix}fuse_epilogue": mods.fuse_epilogue,
        f"{prefix}fp8_chain": mods.fp8_chain,
    }
