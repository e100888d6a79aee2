"""The vocabulary of loka-tune: what a precision choice is, per GEMM, per layer, per model.

Everything here is plain frozen data with string ids, shared by every layer of the package:

- :class:`Format`: an operand's number format (``bf16``, ``e4m3``, ``e5m2``, ``mxfp8``).
- :class:`Granularity`: how operands are scaled (``tensor``, ``row``, ``block``, ``mx``).
- :class:`GemmChoice`: formats of both operands + granularity + scale rounding + fast
  accumulation + backend. ``short_str()`` ("e4m3.row.emulated") is its id everywhere: the
  Optuna choice, the timing-cache key and the MLflow parameter value.
- :class:`SitePrecision`: the three choices of one linear layer (``fwd``, ``dgrad``, ``wgrad``).
- :class:`ModsConfig`: which model adaptations run before the precision swap (its own module,
  :mod:`loka_tune.mods_config`, re-exported here).
- :class:`ServingPlan`: per batch bucket, each site's forward choice for serving (an optional
  ``serving`` section of the config: ``apply(model, config, serving=True, batch=B)``).
- :class:`PrecisionConfig`: mods + default + per-site rules + provenance (+ a serving plan),
  versioned JSON (the file's envelope, schema version and safe reading:
  :mod:`loka_tune.config_file`).

GEMM semantics (the canonical form every backend implements). Each of a linear layer's three
GEMMs is computed as ``A @ B.T`` with both operands laid out so that the reduction dimension
is their last one:

=======  ==================  ===================  =========  ==========================  =========
role     A (rows x red)      B (cols x red)       reduction  output                      (m, k, n)
=======  ==================  ===================  =========  ==========================  =========
fwd      X   (M, K)          W    (N, K)          K          Y  = X W^T      (M, N)      (M, K, N)
dgrad    dY  (M, N)          W^T  (K, N)          N          dX = dY W       (M, K)      (M, N, K)
wgrad    dY^T (N, M)         X^T  (K, M)          M (batch)  dW = dY^T X     (N, K)      (N, M, K)
=======  ==================  ===================  =========  ==========================  =========

This table has one home in code: :meth:`GemmRole.shape` gives a role's canonical ``(m, k, n)``
(rows of A, reduction, rows of B) and :func:`role_operands` its ``(A, B)``; everything else
(cost model, sites, probe, applier) asks them.

"Rowwise" scaling gives one scale per row of A and per row of B, i.e. along the reduction
dimension of each operand: for ``wgrad`` that is one scale per *column* of dY and of X (the
batch dimension is reduced), which is the classic place to get it wrong. "Blockwise" scales
1x128 tiles of activations and gradients and 128x128 tiles of weights (DeepSeek-V3 /
DeepGEMM): in fwd and dgrad, B is the weight (128x128); in wgrad both operands are
activations/gradients (1x128 along the batch dimension). "mx" scales 1x32 tiles along the
reduction dimension with power-of-two (e8m0) scales.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, overload

from loka_tune.config_file import SCHEMA_VERSION, check_envelope, header, parse_json, read_text, write_text
from loka_tune.errors import ConfigError, ServingError
from loka_tune.mods_config import ModsConfig
from loka_tune.recipes import DISPATCH, RECIPE_NAMES, RECIPES  # plain data: imports nothing of loka-tune

if TYPE_CHECKING:  # config stays importable without torch
    from torch import Tensor

__all__ = [
    "SCHEMA_VERSION",
    "Format",
    "Granularity",
    "ScaleRounding",
    "GemmRole",
    "ROLES",
    "role_operands",
    "GemmChoice",
    "SitePrecision",
    "ModsConfig",
    "SiteRule",
    "ServingPlan",
    "PrecisionConfig",
    "BF16",
    "FP8_FORMATS",
]


class Format(str, Enum):
    """Number format of one GEMM operand."""

    BF16 = "bf16"  # no quantization: the operand stays in the ambient precision
    E4M3 = "e4m3"  # torch.float8_e4m3fn, max 448
    E5M2 = "e5m2"  # torch.float8_e5m2, max 57344: for gradients
    MXFP8 = "mxfp8"  # e4m3 elements, one e8m0 (power-of-two) scale per 32 elements

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


FP8_FORMATS = (Format.E4M3, Format.E5M2, Format.MXFP8)


class Granularity(str, Enum):
    """How an operand is scaled before the cast (see the module docstring for the axes)."""

    NONE = "none"  # only with bf16 operands
    TENSOR = "tensor"  # one scale per operand
    ROW = "row"  # one scale per row of the canonical operand (along the reduction dim)
    BLOCK = "block"  # 1x128 activations/gradients, 128x128 weights
    MX = "mx"  # 1x32 along the reduction dim, power-of-two (e8m0) scales

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


class ScaleRounding(str, Enum):
    """Whether scales are used as computed or rounded down to a power of two."""

    EXACT = "exact"
    POW2 = "pow2"

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


class GemmRole(str, Enum):
    """The three GEMMs of a linear layer (their operands and shapes: the module docstring)."""

    FWD = "fwd"  # Y = X W^T
    DGRAD = "dgrad"  # dX = dY W
    WGRAD = "wgrad"  # dW = dY^T X

    def __str__(self) -> str:  # pragma: no cover - trivial
        return str(self.value)

    @overload
    def shape(self, m: int, k: int, n: int) -> tuple[int, int, int]: ...

    @overload
    def shape(self, m: None, k: int, n: int) -> tuple[int | None, int | None, int]: ...

    def shape(self, m: int | None, k: int, n: int) -> tuple[int | None, int | None, int]:
        """The canonical ``(m, k, n)`` of this role's ``A @ B.T`` (rows of A, reduction, rows
        of B) for a linear layer with ``m`` input rows (the batch; ``None`` when unknown), ``k``
        in_features and ``n`` out_features: ``fwd (m, k, n)``, ``dgrad (m, n, k)``,
        ``wgrad (n, m, k)`` (wgrad reduces over the batch)."""
        if self is GemmRole.FWD:
            return m, k, n  # X (m, k) @ W^T -> Y (m, n)
        if self is GemmRole.DGRAD:
            return m, n, k  # dY (m, n) @ W -> dX (m, k)
        return n, m, k  # dY^T (n, m) @ X -> dW (n, k)


ROLES: tuple[GemmRole, ...] = (GemmRole.FWD, GemmRole.DGRAD, GemmRole.WGRAD)


def role_operands(role: GemmRole | str, x: Tensor, dy: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """The canonical ``(A, B)`` of ``role``'s GEMM ``A @ B.T`` from a linear layer's input
    ``x (M, K)``, output gradient ``dy (M, N)`` and weight ``w (N, K)`` (views, no copies)."""
    role = GemmRole(role)
    if role is GemmRole.FWD:
        return x, w  # (M, K), (N, K) -> Y (M, N)
    if role is GemmRole.DGRAD:
        return dy, w.T  # (M, N), (K, N) -> dX (M, K)
    return dy.T, x.T  # (N, M), (K, M) -> dW (N, K)

_BACKEND_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def _enum(cls: type[Enum], value: Any, key: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"got {value!r}; expected one of {valid}", key=key) from None


@dataclass(frozen=True)
class GemmChoice:
    """How one GEMM runs: operand formats, scaling, and the kernel backend.

    ``a_format`` is the first canonical operand (X in fwd, dY in dgrad and wgrad), ``b_format``
    the second (W in fwd, W^T in dgrad, X^T in wgrad). Either both are ``bf16`` (no
    quantization, granularity ``none``) or both are FP8 formats.
    """

    a_format: Format = Format.BF16
    b_format: Format = Format.BF16
    granularity: Granularity = Granularity.NONE
    rounding: ScaleRounding = ScaleRounding.EXACT
    fast_accum: bool = False
    backend: str = "bf16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "a_format", _enum(Format, self.a_format, "a_format"))
        object.__setattr__(self, "b_format", _enum(Format, self.b_format, "b_format"))
        object.__setattr__(self, "granularity", _enum(Granularity, self.granularity, "granularity"))
        object.__setattr__(self, "rounding", _enum(ScaleRounding, self.rounding, "rounding"))
        if not isinstance(self.fast_accum, bool):
            raise ConfigError(f"got {self.fast_accum!r}; expected true or false", key="fast_accum")
        if not isinstance(self.backend, str) or not _BACKEND_RE.match(self.backend):
            raise ConfigError(
                f"got {self.backend!r}; a backend name is lower-case letters, digits and '_'"
                " (e.g. 'emulated', 'torch_scaled_mm', 'fbgemm', 'triton', 'torchao', 'bf16')",
                key="backend",
            )
        a, b, g = self.a_format, self.b_format, self.granularity
        if (a == Format.BF16) != (b == Format.BF16):
            raise ConfigError(
                f"got a_format={a.value!r}, b_format={b.value!r}: mixing bf16 with an FP8 format"
                " in one GEMM is not supported; use bf16 for both or FP8 for both",
                key="a_format",
            )
        if a == Format.BF16:
            if g != Granularity.NONE:
                raise ConfigError(
                    f"got granularity={g.value!r} with bf16 operands: bf16 is not scaled; use 'none'",
                    key="granularity",
                )
            if self.rounding != ScaleRounding.EXACT or self.fast_accum:
                raise ConfigError(
                    "bf16 GEMMs have no scales and no fast accumulation: drop 'pow2'/'fa'",
                    key="rounding",
                )
            return
        if g == Granularity.NONE:
            raise ConfigError(
                f"got granularity='none' with FP8 operands ({a.value}, {b.value}); choose one of"
                " 'tensor', 'row', 'block', 'mx'",
                key="granularity",
            )
        is_mx = (a == Format.MXFP8, b == Format.MXFP8)
        if any(is_mx) and not all(is_mx):
            raise ConfigError(
                f"got a_format={a.value!r}, b_format={b.value!r}: mxfp8 must be used for both operands",
                key="a_format",
            )
        if all(is_mx) != (g == Granularity.MX):
            raise ConfigError(
                f"got formats ({a.value}, {b.value}) with granularity {g.value!r}: mxfp8 goes with"
                " granularity 'mx' and 'mx' only with mxfp8",
                key="granularity",
            )
        if g == Granularity.MX and self.rounding != ScaleRounding.POW2:
            # e8m0 scales are powers of two by definition: normalise instead of rejecting.
            object.__setattr__(self, "rounding", ScaleRounding.POW2)

    # ----------------------------------------------------------------------------- ids
    @property
    def is_bf16(self) -> bool:
        return self.a_format == Format.BF16

    def short_str(self) -> str:
        """A compact, parseable id: ``e4m3.row.emulated``, ``e5m2+e4m3.block.pow2.fa.triton``,
        ``bf16`` (plain bf16 backend) or ``bf16.<backend>``."""
        if self.is_bf16:
            return "bf16" if self.backend == "bf16" else f"bf16.{self.backend}"
        fmt = self.a_format.value
        if self.b_format != self.a_format:
            fmt = f"{self.a_format.value}+{self.b_format.value}"
        parts = [fmt, self.granularity.value]
        if self.rounding == ScaleRounding.POW2 and self.granularity != Granularity.MX:
            parts.append("pow2")
        if self.fast_accum:
            parts.append("fa")
        parts.append(self.backend)
        return ".".join(parts)

    def __str__(self) -> str:
        return self.short_str()

    @classmethod
    def parse(cls, text: GemmChoice | str, *, key: str = "choice") -> "GemmChoice":
        """Inverse of :meth:`short_str` (a :class:`GemmChoice` passes through). Raises
        :class:`ConfigError` naming ``key``."""
        if isinstance(text, GemmChoice):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(
                f"got {text!r}; a GEMM choice is a string like 'e4m3.row.emulated' or 'bf16'", key=key
            )
        parts = text.strip().split(".")
        fmt = parts[0]
        if "+" in fmt:
            a_s, _, b_s = fmt.partition("+")
        else:
            a_s = b_s = fmt
        a = _enum(Format, a_s, key)
        b = _enum(Format, b_s, key)
        if (a == Format.BF16) != (b == Format.BF16):
            raise ConfigError(
                f"got {text!r}: mixing bf16 with an FP8 format in one GEMM is not supported;"
                " use bf16 for both operands or FP8 for both",
                key=key,
            )
        if a == Format.BF16:
            if len(parts) == 1:
                return cls(backend="bf16")
            if len(parts) == 2:
                return cls(backend=parts[1])
            raise ConfigError(f"got {text!r}; a bf16 choice is 'bf16' or 'bf16.<backend>'", key=key)
        if len(parts) < 3:
            raise ConfigError(
                f"got {text!r}; an FP8 choice is '<format>.<granularity>[.pow2][.fa].<backend>',"
                " e.g. 'e4m3.row.emulated'",
                key=key,
            )
        gran = _enum(Granularity, parts[1], key)
        flags, backend = parts[2:-1], parts[-1]
        if backend in ("pow2", "fa"):
            raise ConfigError(
                f"got {text!r}; it ends with the flag {backend!r} where the backend name belongs:"
                f" write '{text.strip()}.emulated' (or another backend)",
                key=key,
            )
        unknown = [f for f in flags if f not in ("pow2", "fa")]
        if unknown or len(set(flags)) != len(flags):
            raise ConfigError(
                f"got {text!r}; unknown or repeated flag(s) {unknown or flags}: the flags between"
                " granularity and backend are 'pow2' (power-of-two scales) and 'fa' (fast accumulation)",
                key=key,
            )
        try:
            return cls(
                a,
                b,
                gran,
                ScaleRounding.POW2 if "pow2" in flags else ScaleRounding.EXACT,
                "fa" in flags,
                backend,
            )
        except ConfigError as e:
            raise ConfigError(f"in {text!r}: {e}", key=key) from None

    # ---------------------------------------------------------------- constructors
    @classmethod
    def bf16(cls, backend: str = "bf16") -> "GemmChoice":
        return cls(backend=backend)

    @classmethod
    def fp8(
        cls,
        granularity: Granularity | str = Granularity.ROW,
        *,
        a_format: Format | str = Format.E4M3,
        b_format: Format | str | None = None,
        rounding: ScaleRounding | str = ScaleRounding.EXACT,
        fast_accum: bool = False,
        backend: str = "emulated",
    ) -> "GemmChoice":
        a = _enum(Format, a_format, "a_format")  # the checks __post_init__ makes, in its order
        b = a if b_format is None else _enum(Format, b_format, "b_format")
        return cls(a, b, _enum(Granularity, granularity, "granularity"), _enum(ScaleRounding, rounding, "rounding"),
                   fast_accum, backend)

    def with_backend(self, backend: str) -> "GemmChoice":
        return replace(self, backend=backend)


BF16 = GemmChoice()


def _choice(value: Any, key: str) -> GemmChoice:
    if isinstance(value, GemmChoice):
        return value
    return GemmChoice.parse(value, key=key)


@dataclass(frozen=True)
class SitePrecision:
    """The three GEMM choices of one linear layer."""

    fwd: GemmChoice = BF16
    dgrad: GemmChoice = BF16
    wgrad: GemmChoice = BF16

    def __post_init__(self) -> None:
        for role in ROLES:
            object.__setattr__(self, role.value, _choice(getattr(self, role.value), role.value))

    def __getitem__(self, role: GemmRole | str) -> GemmChoice:
        choice: GemmChoice = getattr(self, GemmRole(role).value)
        return choice

    @property
    def is_bf16(self) -> bool:
        return all(self[r].is_bf16 for r in ROLES)

    @classmethod
    def uniform(cls, choice: GemmChoice | str) -> "SitePrecision":
        c = _choice(choice, "choice")
        return cls(c, c, c)

    def short_str(self) -> str:
        """``fwd|dgrad|wgrad`` ids, or one id when all three agree."""
        ids = [self[r].short_str() for r in ROLES]
        return ids[0] if len(set(ids)) == 1 else "|".join(ids)

    @classmethod
    def parse(cls, text: str, *, key: str = "site") -> "SitePrecision":
        if not isinstance(text, str):
            raise ConfigError(f"got {text!r}; expected 'choice' or 'fwd|dgrad|wgrad' choices", key=key)
        parts = text.split("|")
        if len(parts) == 1:
            return cls.uniform(GemmChoice.parse(parts[0], key=key))
        if len(parts) != 3:
            raise ConfigError(
                f"got {text!r}; give one choice for all three GEMMs or three as 'fwd|dgrad|wgrad'", key=key
            )
        return cls(*(GemmChoice.parse(p, key=f"{key}.{r.value}") for p, r in zip(parts, ROLES)))

    def to_dict(self) -> dict[str, str]:
        return {r.value: self[r].short_str() for r in ROLES}

    @classmethod
    def from_obj(cls, obj: Any, *, key: str = "site") -> "SitePrecision":
        """From a string (see :meth:`parse`) or a mapping ``{"fwd": ..., "dgrad": ..., "wgrad": ...}``."""
        if isinstance(obj, SitePrecision):
            return obj
        if isinstance(obj, str):
            return cls.parse(obj, key=key)
        if isinstance(obj, Mapping):
            unknown = set(obj) - {r.value for r in ROLES}
            if unknown:
                raise ConfigError(
                    f"unknown key(s) {sorted(unknown)}; a site has 'fwd', 'dgrad' and 'wgrad'", key=key
                )
            missing = [r.value for r in ROLES if r.value not in obj]
            if missing:
                raise ConfigError(f"missing {missing}; give all of 'fwd', 'dgrad', 'wgrad'", key=key)
            return cls(*(GemmChoice.parse(obj[r.value], key=f"{key}.{r.value}") for r in ROLES))
        raise ConfigError(f"got {type(obj).__name__} {obj!r}; expected a string or a mapping", key=key)


@dataclass(frozen=True)
class SiteRule:
    """A per-site entry: ``pattern`` is an exact module name, or ``re:<regex>`` (fullmatch)."""

    pattern: str
    precision: SitePrecision

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ConfigError(f"got {self.pattern!r}; expected a module name or 're:<regex>'", key="sites")
        if self.is_regex:
            try:
                re.compile(self.pattern[3:])
            except re.error as e:
                raise ConfigError(
                    f"bad regular expression {self.pattern[3:]!r}: {e}", key=f"sites.{self.pattern}"
                ) from None

    @property
    def is_regex(self) -> bool:
        return self.pattern.startswith("re:")

    def matches(self, name: str) -> bool:
        if self.is_regex:
            return re.fullmatch(self.pattern[3:], name) is not None
        return self.pattern == name


_TIME_SOURCES = ("modeled", "measured", "mixed", "given")  # mixed: measured until a budget, then modeled


@dataclass(frozen=True)
class ServingPlan:
    """Per batch bucket, the forward GEMM choice of each site when serving: the ``serving``
    section of a precision config, read by ``apply(model, config, serving=True, batch=B)``.

    ``buckets``: ``((rows, {site: GemmChoice}), ...)`` sorted by ``rows`` (the batch size a
    bucket serves, padded up to); ``bf16`` keeps a site in bf16 at that bucket (FP8 does not
    pay there). Sites are exact layer names; a site a bucket does not list serves the config's
    own fwd choice. ``time_source``: how the buckets were priced (``"modeled"``: the cost
    model, ``"measured"``: timed on ``device``, ``"mixed"``: both, ``"given"``: written by
    hand); ``prices``:
    the record of the pricing (free-form JSON, e.g. ``{bucket: {site: {choice: us}}}``).

    JSON: ``{"buckets": {"512": {site: choice, ...}, ...}, "time_source": ..., "device": ...,
    "prices": {...}}``. It does not change training: :meth:`PrecisionConfig.key` ignores it.
    """

    buckets: tuple[tuple[int, Mapping[str, GemmChoice]], ...] = ()
    time_source: str = "given"
    device: str = ""
    prices: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        raw = self.buckets.items() if isinstance(self.buckets, Mapping) else self.buckets
        out: dict[int, dict[str, GemmChoice]] = {}
        for entry in raw:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ConfigError(f"got {entry!r}; a bucket is (rows, {{site: choice}})", key="serving.buckets")
            rows, sites = entry
            n = _bucket_rows(rows)
            if n in out:
                raise ConfigError(f"the bucket {n} is listed twice", key=f"serving.buckets.{n}")
            if not isinstance(sites, Mapping):
                raise ConfigError(f"got {type(sites).__name__} {sites!r:.60}; a bucket maps site names to fwd"
                                  " choices, e.g. {\"head_mlp.0.linear\": \"e4m3.row.torch_scaled_mm\"}",
                                  key=f"serving.buckets.{n}")
            choices: dict[str, GemmChoice] = {}
            for site, c in sites.items():
                if not isinstance(site, str) or not site or site.startswith("re:"):
                    raise ConfigError(f"got site {site!r}; a serving bucket names sites exactly (no 're:' rules)",
                                      key=f"serving.buckets.{n}")
                choices[site] = _choice(c, f"serving.buckets.{n}.{site}")
            out[n] = choices
        object.__setattr__(self, "buckets", tuple(sorted(out.items())))
        if self.time_source not in _TIME_SOURCES:
            raise ConfigError(f"got {self.time_source!r}; expected one of {', '.join(_TIME_SOURCES)}",
                              key="serving.time_source")
        if not isinstance(self.device, str):
            raise ConfigError(f"got {self.device!r}; expected a device name", key="serving.device")
        if not isinstance(self.prices, Mapping):
            raise ConfigError(f"got {self.prices!r}; expected an object", key="serving.prices")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The buckets' batch sizes, ascending."""
        return tuple(n for n, _ in self.buckets)

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket that holds ``batch`` rows (the batch is padded up to it).

        Raises :class:`ServingError` for a batch above every bucket (or not a positive int).
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ServingError(f"got batch={batch!r}; a batch size is a positive integer")
        if not self.buckets:
            raise ServingError(f"batch {batch}: this serving plan has no bucket; price one with"
                               " loka_tune.serving.plan_serving(model, config, inputs, buckets=[...])")
        for n in self.sizes:
            if batch <= n:
                return n
        raise ServingError(
            f"batch {batch} is above every bucket of the serving plan ({', '.join(map(str, self.sizes))}):"
            f" serve it in chunks of at most {self.sizes[-1]} rows, or price a plan with a bucket >= {batch}"
            f" (loka_tune.serving.plan_serving(..., buckets=[..., {batch}]))")

    def choices(self, bucket: int) -> dict[str, GemmChoice]:
        """``{site: fwd choice}`` of ``bucket`` (one of :attr:`sizes`)."""
        for n, c in self.buckets:
            if n == bucket:
                return dict(c)
        raise ServingError(f"got bucket {bucket!r}; the serving plan's buckets are {list(self.sizes)}")

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": {str(n): {s: c.short_str() for s, c in sites.items()} for n, sites in self.buckets},
                "time_source": self.time_source, "device": self.device, "prices": dict(self.prices)}

    @classmethod
    def from_dict(cls, obj: Any, *, key: str = "serving") -> "ServingPlan":
        if isinstance(obj, ServingPlan):
            return obj
        if not isinstance(obj, Mapping):
            raise ConfigError(f"got {type(obj).__name__} {obj!r:.60}; the serving section is an object"
                              " {\"buckets\": {\"512\": {site: choice}, ...}}", key=key)
        unknown = set(obj) - {"buckets", "time_source", "device", "prices"}
        if unknown:
            raise ConfigError(f"unknown key(s) {sorted(unknown)}; valid keys: buckets, time_source, device, prices",
                              key=key)
        buckets = obj.get("buckets", {})
        if not isinstance(buckets, Mapping):
            raise ConfigError(f"got {type(buckets).__name__}; expected an object of batch size -> sites",
                              key=f"{key}.buckets")
        return cls(buckets=tuple(buckets.items()), time_source=obj.get("time_source", "given"),
                   device=obj.get("device", ""), prices=obj.get("prices", {}))


def _bucket_rows(rows: Any) -> int:
    """A bucket's batch size from its JSON key (``"512"``) or an int."""
    if isinstance(rows, str) and rows.strip().isdigit():
        rows = int(rows.strip())
    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise ConfigError(f"got bucket {rows!r}; a bucket is a positive batch size such as \"512\"",
                          key="serving.buckets")
    return rows


@dataclass(frozen=True)
class PrecisionConfig:
    """A whole model's precision plan: mods, a default, per-site rules and provenance.

    Resolution for a layer name: the exact-name rule, else the first matching ``re:`` rule
    (in file order), else ``default``. ``sites`` may be given as a mapping ``{name or
    "re:<regex>": SitePrecision or its id}`` (kept in order as :class:`SiteRule` entries). ``provenance`` records where the config came from
    (study, trial, metrics, device, versions): free-form JSON-able data. ``serving``: an optional
    :class:`ServingPlan` (per batch bucket, the fwd choice of each site when serving).
    """

    default: SitePrecision = field(default_factory=SitePrecision)
    sites: tuple[SiteRule, ...] = ()
    mods: ModsConfig = field(default_factory=ModsConfig)
    provenance: Mapping[str, Any] = field(default_factory=dict)
    serving: ServingPlan | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mods", ModsConfig.of(self.mods))  # a mapping as in the JSON file is taken too
        if self.serving is not None and not isinstance(self.serving, ServingPlan):
            object.__setattr__(self, "serving", ServingPlan.from_dict(self.serving))
        sites = self.sites
        if isinstance(sites, Mapping):  # {name or "re:<regex>": SitePrecision or its id}, in order
            sites = tuple(SiteRule(k, v if isinstance(v, SitePrecision) else SitePrecision.from_obj(v, key=f"sites.{k}"))
                          for k, v in sites.items())
        sites = tuple(sites)
        bad = [r for r in sites if not isinstance(r, SiteRule)]
        if bad:
            raise ConfigError(f"got {bad[0]!r}; sites take SiteRule(pattern, precision) entries or a mapping"
                              " {site name or 're:<regex>': precision}", key="sites")
        object.__setattr__(self, "sites", sites)
        seen: set[str] = set()
        for rule in sites:
            if rule.pattern in seen:
                raise ConfigError(f"the site {rule.pattern!r} is listed twice", key=f"sites.{rule.pattern}")
            seen.add(rule.pattern)

    # ---------------------------------------------------------------- resolution
    def resolve(self, name: str) -> SitePrecision:
        """The precision of the linear layer named ``name``."""
        rule = self.rule_for(name)
        return self.default if rule is None else rule.precision

    def rule_for(self, name: str) -> SiteRule | None:
        for rule in self.sites:
            if not rule.is_regex and rule.pattern == name:
                return rule
        for rule in self.sites:
            if rule.is_regex and rule.matches(name):
                return rule
        return None

    def unmatched_rules(self, names: Iterable[str]) -> list[str]:
        """Patterns that match none of ``names`` (a config for another model, or a typo)."""
        names = list(names)
        return [r.pattern for r in self.sites if not any(r.matches(n) for n in names)]

    @classmethod
    def from_sites(
        cls,
        sites: Mapping[str, SitePrecision | str],
        *,
        default: SitePrecision | str | None = None,
        mods: ModsConfig | Mapping[str, Any] | None = None,
        provenance: Mapping[str, Any] | None = None,
    ) -> "PrecisionConfig":
        return cls(
            default=SitePrecision() if default is None else SitePrecision.from_obj(default, key="default"),
            sites=tuple(SiteRule(k, SitePrecision.from_obj(v, key=f"sites.{k}")) for k, v in sites.items()),
            mods=ModsConfig.of(mods),
            provenance=dict(provenance or {}),
        )

    @classmethod
    def from_recipe(
        cls,
        name: str,
        *,
        backend: str = "torch_scaled_mm",
        mods: ModsConfig | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> "PrecisionConfig":
        """A named uniform recipe (the table: :data:`loka_tune.recipes.RECIPES`):

        - ``"bf16"``: every GEMM in bf16 (the baseline; combine it with ``mods``);
        - ``"tensorwise"``: every GEMM e4m3 with one scale per tensor;
        - ``"tensorwise_fa"``: the same with fast accumulation in all three GEMMs;
        - ``"rowwise"``: every GEMM e4m3 with one power-of-two scale per row;
        - ``"rowwise_with_gw_hp"``: rowwise fwd and dgrad, wgrad kept in bf16.

        ``backend`` names the kernel library of the FP8 recipes: ``torch_scaled_mm`` (cuBLASLt,
        the default), ``torchao``, ``fbgemm``, ``triton``, or ``emulated`` (runs anywhere, for
        checking numerics). ``mods``: the model adaptations to apply first (a
        :class:`ModsConfig`, or a mapping such as ``{"no_bias": True}`` as in the JSON file).
        The ``"dispatch"`` recipe (LoKA's per-GEMM plan) is built from a probe report, a layer
        above this vocabulary: ``loka_tune.recipe_config("dispatch", report=...)``."""
        if name == DISPATCH:
            raise ConfigError(
                "the 'dispatch' recipe is built from a probe report: call loka_tune.recipe_config('dispatch',"
                " report=<a Probe's report or a saved probe report>) or loka_tune.build_plan(report)", key="recipe")
        if name not in RECIPES:
            raise ConfigError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPE_NAMES)}", key="recipe")
        if options:
            raise ConfigError(f"{', '.join(sorted(options))} belong(s) to the 'dispatch' recipe, not to {name!r};"
                              " drop them", key="recipe")
        if backend == "bf16" and name != "bf16":
            raise ConfigError(f"the {name!r} recipe runs FP8 GEMMs; name an FP8 backend such as 'torch_scaled_mm',"
                              " 'torchao', 'fbgemm', 'triton' or 'emulated'", key="backend")
        site = SitePrecision.parse(RECIPES[name].format(backend=backend), key="recipe")
        return cls(default=site, mods=ModsConfig.of(mods),
                   provenance={"source": f"loka-tune recipe {name}", "recipe": name, "backend": backend})

    def with_provenance(self, **kw: Any) -> "PrecisionConfig":
        return replace(self, provenance={**self.provenance, **kw})

    def with_serving(self, plan: ServingPlan | Mapping[str, Any] | None) -> "PrecisionConfig":
        """This config with the serving plan ``plan`` (``None``: without one)."""
        return replace(self, serving=None if plan is None else ServingPlan.from_dict(plan))

    def key(self) -> str:
        """A canonical string of what changes training numerics (mods, default, rules; not the
        serving plan): the trial cache key."""
        body = {"mods": self.mods.to_dict(), "default": self.default.to_dict(),
                "sites": [[r.pattern, r.precision.to_dict()] for r in self.sites]}
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    # ---------------------------------------------------------------- JSON (the envelope: config_file.py)
    def to_dict(self) -> dict[str, Any]:
        return {
            **header(),
            "mods": self.mods.to_dict(),
            "default": self.default.to_dict(),
            "sites": {r.pattern: r.precision.to_dict() for r in self.sites},
            "provenance": dict(self.provenance),
            # only when present: older readers reject the key, and configs without a plan stay as they were
            **({"serving": self.serving.to_dict()} if self.serving is not None else {}),
        }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False, default=str)

    @classmethod
    def from_dict(cls, obj: Any) -> "PrecisionConfig":
        obj = check_envelope(obj)
        return cls(
            default=SitePrecision.from_obj(obj.get("default", "bf16"), key="default"),
            sites=tuple(
                SiteRule(str(k), SitePrecision.from_obj(v, key=f"sites.{k}")) for k, v in obj.get("sites", {}).items()
            ),
            mods=ModsConfig.from_dict(obj.get("mods"), key="mods"),
            provenance=dict(obj.get("provenance", {})),
            serving=ServingPlan.from_dict(obj["serving"]) if obj.get("serving") is not None else None,
        )

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> "PrecisionConfig":
        return cls.from_dict(parse_json(text, source=source))

    def save(self, path: str | Path) -> Path:
        """Write the config as JSON (atomically: a crash never leaves half a file)."""
        return write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "PrecisionConfig":
        """Read a config file; an error in it names the file as well as the key."""
        try:
            return cls.from_json(read_text(path), source=str(Path(path)))
        except ConfigError as e:
            raise e.in_file(path) from None  # unchanged when it names the file already (a file-level error)
