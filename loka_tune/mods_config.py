"""Which model adaptations (Mods) run before the precision swap: :class:`ModsConfig`.

Plain frozen data, part of the precision-config vocabulary; import it from
:mod:`loka_tune.config` (``from loka_tune.config import ModsConfig``). The passes themselves
live in :mod:`loka_tune.mods`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Sequence

from loka_tune.errors import ConfigError

__all__ = ["ModsConfig", "check_chain_space"]


@dataclass(frozen=True)
class ModsConfig:
    """Which model adaptations (Mods) run, and with which parameters, before the precision swap.

    ``no_bias``: drop linear biases except in ``keep_bias`` (module names; the model's
    prediction head is always kept). ``blocknorm``: block size of BlockNorm replacing
    LayerNorm/RMSNorm (``None``: off). ``hardswish``: Hard Swish in place of SiLU/Swish(-LN).
    ``pad``: pad linear K and N up to this multiple (``None``: off). ``fuse_epilogue``: after
    the precision swap, run each (Linear, BlockNorm, Hard Swish) chain as one fused FP8 GEMM
    epilogue (:class:`loka_tune.kernels.fused.FusedLinearBlockNormHardswish`) with its linear
    site's own fwd / dgrad / wgrad choices, where the fused kernel runs that fwd choice
    (rowwise e4m3/e5m2 ``.triton`` on CUDA, any ``.emulated`` choice); other chains stay
    unfused and :func:`loka_tune.apply` reports why. It changes no numerics of an ``.emulated``
    site and only makes sense with ``blocknorm`` and Hard Swish on. ``fp8_chain``: run each
    MLP of bias-free (Linear, BlockNorm(256), Hard Swish) blocks whose sites are all e4m3
    tensorwise on ``torch_scaled_mm`` (and the linear the model names after it, e.g. a Wukong
    FMB's ``out``) as one FP8 chain (:class:`loka_tune.kernels.chain.ChainMLP`): its norms write
    the next GEMM's FP8 operands with delayed scales; other MLPs stay as they are and
    :func:`loka_tune.apply` reports why. It needs ``no_bias``, ``blocknorm = 256`` and Hard
    Swish, and excludes ``fuse_epilogue`` (both take the same blocks). In JSON the keys
    ``fuse_epilogue`` and ``fp8_chain`` are written only when on, so configs without them stay
    readable by earlier versions (and old files, which lack them, load with them off).
    """

    no_bias: bool = False
    keep_bias: tuple[str, ...] = ()
    blocknorm: int | None = None
    hardswish: bool = False
    pad: int | None = None
    fuse_epilogue: bool = False
    fp8_chain: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_bias", tuple(self.keep_bias))
        for name in ("blocknorm", "pad"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ConfigError(f"got {v!r}; expected a positive integer or null (off)", key=f"mods.{name}")
        for name in ("no_bias", "hardswish", "fuse_epilogue", "fp8_chain"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"got {getattr(self, name)!r}; expected true or false", key=f"mods.{name}")
        if self.fp8_chain and self.fuse_epilogue:
            raise ConfigError("fp8_chain and fuse_epilogue both take the (Linear, BlockNorm, Hard Swish) blocks;"
                              " turn one of them off", key="mods.fp8_chain")
        if self.fp8_chain and not (self.no_bias and self.blocknorm == 256 and self.hardswish):
            raise ConfigError("fp8_chain runs MLPs of bias-free Linear -> BlockNorm(256) -> Hard Swish blocks; turn on"
                              " no_bias, blocknorm = 256 and hardswish with it (or fp8_chain off)", key="mods.fp8_chain")

    @property
    def any(self) -> bool:
        """Whether any Mod is on (``fuse_epilogue`` and ``fp8_chain`` included)."""
        return self.any_pass or self.fuse_epilogue or self.fp8_chain

    @property
    def any_pass(self) -> bool:
        """Whether any model pass of :func:`loka_tune.mods.apply_mods` is on (all but ``fuse_epilogue``
        and ``fp8_chain``)."""
        return self.no_bias or self.blocknorm is not None or self.hardswish or self.pad is not None

    @property
    def passes(self) -> "ModsConfig":
        """These Mods without ``fuse_epilogue`` and ``fp8_chain``: what :func:`loka_tune.mods.apply_mods`
        changes (fusion and chains run in :func:`loka_tune.apply`, around the precision swap)."""
        return replace(self, fuse_epilogue=False, fp8_chain=False) if self.fuse_epilogue or self.fp8_chain else self

    def short_str(self) -> str:
        parts = []
        if self.no_bias:
            parts.append("nobias")
        if self.blocknorm is not None:
            parts.append(f"bn{self.blocknorm}")
        if self.hardswish:
            parts.append("hswish")
        if self.pad is not None:
            parts.append(f"pad{self.pad}")
        if self.fuse_epilogue:
            parts.append("fused")
        if self.fp8_chain:
            parts.append("chain")
        return "+".join(parts) or "none"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; ``fuse_epilogue`` and ``fp8_chain`` appear only when on (older readers
        reject the keys, and the trial cache keys of configs without them stay what they were)."""
        d = asdict(self)
        d["keep_bias"] = list(self.keep_bias)
        for name in ("fuse_epilogue", "fp8_chain"):
            if not d[name]:
                del d[name]
        return d

    @classmethod
    def of(cls, obj: "ModsConfig | Mapping[str, Any] | None", *, key: str = "mods") -> "ModsConfig":
        """``obj`` as a ModsConfig: itself, the mapping of the JSON file's ``mods``, or None (no Mods)."""
        if isinstance(obj, cls):
            return obj
        if obj is None or isinstance(obj, Mapping):
            return cls.from_dict(obj, key=key)
        raise ConfigError(f"got {obj!r}; mods take a ModsConfig or a mapping such as"
                          " {'no_bias': True, 'blocknorm': 256}", key=key)

    @classmethod
    def from_dict(cls, obj: Any, *, key: str = "mods") -> "ModsConfig":
        if obj is None:
            return cls()
        if not isinstance(obj, Mapping):
            raise ConfigError(f"got {obj!r}; expected a mapping of mod names to settings", key=key)
        fields_ = {f for f in cls.__dataclass_fields__}
        unknown = set(obj) - fields_
        if unknown:
            raise ConfigError(f"unknown key(s) {sorted(unknown)}; valid keys: {sorted(fields_)}", key=key)
        kb = obj.get("keep_bias", ())
        if isinstance(kb, str) or not isinstance(kb, (list, tuple)) or not all(isinstance(x, str) for x in kb):
            raise ConfigError(f"got {kb!r}; expected a list of module names", key=f"{key}.keep_bias")
        return cls(**{**obj, "keep_bias": tuple(kb)})


def check_chain_space(mods: Sequence[str], blocknorm_sizes: Sequence[int]) -> None:
    """Raise :class:`ConfigError` where a study's ``[space] mods`` lists ``fp8_chain`` without what
    its chains need (``no_bias``, ``blocknorm`` with 256 among ``blocknorm_sizes``, ``hardswish``)
    or beside ``fuse_epilogue`` (both take the same blocks)."""
    if "fp8_chain" not in mods:
        return
    if not {"no_bias", "blocknorm", "hardswish"} <= set(mods):
        raise ConfigError(f"got {list(mods)!r}: 'fp8_chain' runs MLPs of bias-free Linear -> BlockNorm(256) -> Hard Swish"
                          " blocks as FP8 chains, which exist only with the no_bias, blocknorm and hardswish Mods on;"
                          " add them to space.mods (or drop 'fp8_chain')", key="space.mods")
    if "fuse_epilogue" in mods:
        raise ConfigError(f"got {list(mods)!r}: 'fp8_chain' and 'fuse_epilogue' both take the Linear -> BlockNorm ->"
                          " Hard Swish blocks; keep one of them in space.mods", key="space.mods")
    if 256 not in blocknorm_sizes:
        raise ConfigError(f"got blocknorm_sizes = {list(blocknorm_sizes)!r} with 'fp8_chain' in space.mods: the chains'"
                          " norms are BlockNorm(256); add 256 to blocknorm_sizes (or drop 'fp8_chain')",
                          key="space.blocknorm_sizes")
