"""The GEMM backend registry: string names -> :class:`Backend` implementations.

A backend computes one canonical GEMM ``a @ b.T`` (``a``: ``(m, k)``, ``b``: ``(n, k)``, the
reduction on the last dim of both; see :mod:`loka_tune.config`) under a
:class:`~loka_tune.config.GemmChoice`. It declares what it can run (formats, granularities,
roles, rounding, fast accumulation, devices, alignment) and :meth:`Backend.supports` checks a
request against that; anything more specific (a shape limit) is a subclass override.

Two backends live here: ``bf16`` (a plain matmul in the operands' dtype) and ``emulated``
(the reference quantization of :mod:`loka_tune.kernels.quant`, then a float32 matmul; see
:mod:`loka_tune.kernels.emulated`). The GPU backends (``torch_scaled_mm``, ``fbgemm``,
``triton``, ``torchao``) are *lazily registered*: :data:`LAZY_BACKENDS` maps their names to
the module that defines them, :func:`list_backends` lists them without importing anything,
and :func:`get_backend` imports the module on first use (its ``@register_backend`` runs),
turning an ``ImportError`` into a :class:`BackendError` that says what to install.

Output dtype rule: every backend returns ``a.dtype`` (bf16 in, bf16 out); callers cast
``a`` and ``b`` to one dtype first.
"""

from __future__ import annotations

import importlib
import itertools
import re
from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Iterable, Sequence, TypeVar

import torch

from loka_tune.config import (
    FP8_FORMATS,
    ROLES,
    Format,
    GemmChoice,
    GemmRole,
    Granularity,
    ScaleRounding,
)
from loka_tune.errors import BackendError, UnsupportedChoiceError

__all__ = [
    "Backend",
    "LAZY_BACKENDS",
    "register_backend",
    "register_lazy_backend",
    "unregister_backend",
    "get_backend",
    "list_backends",
    "check_supported",
    "candidate_choices",
    "device_type",
    "Shape",
    "SHAPE_FALLBACKS",
]

#: Canonical ``(m, k, n)`` of one GEMM (rows of A, reduction, rows of B); ``None`` = not known yet
#: (e.g. the batch size at :func:`loka_tune.applier.apply` time).
Shape = tuple[int | None, int | None, int | None]

_ALL_FORMATS = frozenset(Format)
_FP8_GRANS = frozenset({Granularity.TENSOR, Granularity.ROW, Granularity.BLOCK, Granularity.MX})


def device_type(device: str | torch.device | None) -> str:
    """``"cuda:1"`` / ``torch.device("cuda", 1)`` -> ``"cuda"``; ``None`` -> ``"cpu"``."""
    if device is None:
        return "cpu"
    return torch.device(device).type


class Backend(ABC):
    """A GEMM implementation: subclass, declare capabilities, implement :meth:`gemm`, decorate
    with ``@register_backend("name")``.

    Class attributes (capabilities, checked by the default :meth:`supports`):

    - ``formats``: operand formats it runs (``bf16`` included if it runs plain GEMMs).
    - ``granularities``: scaling granularities (``none`` for bf16).
    - ``roles``: which of fwd / dgrad / wgrad (e.g. a kernel that needs a K-major B).
    - ``roundings``: scale roundings (``exact``, ``pow2``).
    - ``fast_accum_modes``: accepted values of ``fast_accum``; ``enumerated_fast_accum``: the
      ones :func:`candidate_choices` lists by default (modes that differ numerically or in speed).
    - ``devices``: device types (``"cpu"``, ``"cuda"``).
    - ``alignment``: ``k`` and ``n`` of the canonical shape must be multiples of it.
    - ``install_hint``: what to install when its imports are missing.
    """

    name: ClassVar[str] = ""
    formats: ClassVar[frozenset[Format]] = _ALL_FORMATS
    granularities: ClassVar[frozenset[Granularity]] = frozenset(Granularity)
    roles: ClassVar[frozenset[GemmRole]] = frozenset(ROLES)
    roundings: ClassVar[frozenset[ScaleRounding]] = frozenset(ScaleRounding)
    fast_accum_modes: ClassVar[tuple[bool, ...]] = (False,)
    enumerated_fast_accum: ClassVar[tuple[bool, ...] | None] = None  # None: fast_accum_modes
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    alignment: ClassVar[int] = 1
    install_hint: ClassVar[str] = ""
    #: the kernels fail to launch at some real shapes (a grid limit at large m, say), which
    #: :meth:`runtime_reason` names: LokaLinear checks it per call (once per compiled graph)
    #: and runs that GEMM in bf16, recorded in :data:`SHAPE_FALLBACKS`, instead of crashing
    runtime_shape_check: ClassVar[bool] = False
    #: granularities whose fwd GEMM this backend serves with a weight quantized once, ahead of
    #: time (:meth:`quantize_weight` + :meth:`static_gemm`: ``apply(..., serving=True)``); empty:
    #: no static-weight path
    static_granularities: ClassVar[frozenset[Granularity]] = frozenset()
    #: granularities whose serving fwd GEMM also takes the activation's scale fixed ahead of time
    #: (calibrated: :meth:`calibrated_gemm`); empty: the activation is always scaled per call
    calibrated_granularities: ClassVar[frozenset[Granularity]] = frozenset()

    def supports(
        self,
        choice: GemmChoice,
        role: GemmRole | str,
        *,
        device: str | torch.device | None = None,
        shape: Shape | None = None,
    ) -> str | None:
        """``None`` if this backend runs ``choice`` for ``role`` on ``device`` at ``shape``
        (canonical ``(m, k, n)``; unknown dims are ``None``), else the reason it cannot."""
        role = GemmRole(role)
        if choice.backend != self.name:
            return f"the choice names backend {choice.backend!r}, not {self.name!r}"
        fmts = {choice.a_format, choice.b_format}
        bad = sorted(f.value for f in fmts - self.formats)
        if bad:
            return f"format(s) {bad} not supported"
        if choice.granularity not in self.granularities:
            return f"granularity {choice.granularity.value!r} not supported"
        if role not in self.roles:
            return f"role {role.value!r} not supported"
        if not choice.is_bf16 and choice.rounding not in self.roundings:
            return f"scale rounding {choice.rounding.value!r} not supported"
        if choice.fast_accum not in self.fast_accum_modes:
            return f"fast_accum={choice.fast_accum} not supported"
        dev = device_type(device)
        if dev not in self.devices:
            return f"device {dev!r} not supported"
        return self.shape_reason(role, shape)

    def shape_reason(self, role: GemmRole | str, shape: Shape | None) -> str | None:
        """Why ``shape`` (canonical ``(m, k, n)``) breaks this backend's alignment of ``k`` and
        ``n``, or None (the shape part of :meth:`supports`)."""
        if shape is not None and self.alignment > 1:
            _, k, n = shape
            for dim, v in (("k", k), ("n", n)):
                if v is not None and v % self.alignment:
                    return (f"{dim}={v} of the {GemmRole(role).value} GEMM (m, k, n)={tuple(shape)} is not a multiple"
                            f" of {self.alignment}")
        return None

    def describe(self) -> str:
        """One line of capabilities, quoted in :class:`UnsupportedChoiceError` messages."""
        return (
            f"formats {sorted(f.value for f in self.formats)}, granularities "
            f"{sorted(g.value for g in self.granularities)}, roles {[r.value for r in ROLES if r in self.roles]}, "
            f"rounding {sorted(r.value for r in self.roundings)}, fast_accum {list(self.fast_accum_modes)}, "
            f"devices {sorted(self.devices)}"
            + (f", k and n multiples of {self.alignment}" if self.alignment > 1 else "")
        )

    def runtime_reason(self, choice: GemmChoice, role: GemmRole, shape: tuple[int, int, int]) -> str | None:
        """Why this GEMM cannot launch at the real canonical ``(m, k, n)``, or None.

        Consulted per call only when ``runtime_shape_check`` is set; plain Python on ints (no
        torch calls) so that ``torch.compile`` folds it at trace time. Override it, or
        ``extra_reason`` on GPU backends (their default here).
        """
        extra = getattr(self, "extra_reason", None)
        return extra(choice, role, shape) if extra is not None else None

    def direct(self, choice: GemmChoice, role: GemmRole) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """A callable ``f(a, b) -> a @ b.T`` that :class:`~loka_tune.kernels.linear.LokaLinear`
        calls directly, resolved once when a layer's precision is set, or ``None`` (the default)
        to go through the ``loka::gemm`` custom op (which also runs the non-finite fallback).

        GPU backends return one: traceable torch code that ``torch.compile`` sees whole, or one
        opaque custom-op call per GEMM; either way no registry look-up per call.
        """
        return None

    # ------------------------------------------------------------------ serving: a static weight
    def static_reason(self, choice: GemmChoice) -> str | None:
        """None when this backend serves ``choice``'s fwd GEMM with a static weight (quantized
        once by :meth:`quantize_weight`, then only the activation per call by
        :meth:`static_gemm`); otherwise why not. Devices and shapes are :meth:`supports`' job."""
        if choice.is_bf16:
            return f"{choice.short_str()!r} is a bf16 choice: there is no weight to quantize"
        if not self.static_granularities:
            return f"backend {self.name!r} has no static-weight (serving) path"
        if choice.granularity not in self.static_granularities:
            return (f"backend {self.name!r} serves static weights with granularities"
                    f" {sorted(g.value for g in self.static_granularities)}, not {choice.granularity.value!r}")
        return None

    def quantize_weight(self, w: torch.Tensor, choice: GemmChoice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)``: the weight ``w`` ``(N, K)`` quantized once for ``choice``'s fwd GEMM,
        in the layout and scale convention of :meth:`static_gemm` (backend-specific)."""
        raise UnsupportedChoiceError(f"{choice.short_str()!r}: {self.static_reason(choice)}")

    def static_gemm(self, choice: GemmChoice) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The call path ``f(x, data, scale) -> x @ W^T`` (``x`` ``(M, K)``, output ``(M, N)`` in
        ``x.dtype``) of a weight quantized by :meth:`quantize_weight`: only ``x`` is quantized
        per call. Resolved once (a layer's serving form keeps it)."""
        raise UnsupportedChoiceError(f"{choice.short_str()!r}: {self.static_reason(choice)}")

    def calibrated_reason(self, choice: GemmChoice) -> str | None:
        """None when this backend serves ``choice``'s fwd GEMM with a static weight *and* a
        calibrated (fixed) activation scale (:meth:`calibrated_gemm`); otherwise why not."""
        why = self.static_reason(choice)
        if why is not None:
            return why
        if choice.granularity not in self.calibrated_granularities:
            if not self.calibrated_granularities:
                return f"backend {self.name!r} scales the activation per call only (no calibrated-scale path)"
            return (f"backend {self.name!r} takes calibrated activation scales with granularities"
                    f" {sorted(g.value for g in self.calibrated_granularities)}, not {choice.granularity.value!r}"
                    " (a row's scale follows its request: it cannot be fixed ahead of time)")
        return None

    def calibrated_gemm(self, choice: GemmChoice) -> Callable[..., torch.Tensor]:
        """The call path ``f(x, act_scale, data, scale, act_inv=None) -> x @ W^T`` of :meth:`static_gemm`
        with the activation quantized with a fixed multiplier ``act_scale`` (float32 ``()``: the
        reference ``fmax / amax`` of a calibration) instead of its own amax: no reduction per call.
        ``act_inv`` is ``act_scale.reciprocal()`` precomputed (a backend may use it as the GEMM's
        dequantization factor rather than compute it per call).
        Quantizing with the scale the call's own amax gives is bit for bit the dynamic path."""
        raise UnsupportedChoiceError(f"{choice.short_str()!r}: {self.calibrated_reason(choice)}")

    @abstractmethod
    def gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        """``a @ b.T`` for ``a`` ``(m, k)``, ``b`` ``(n, k)`` (same dtype, any strides), in ``a.dtype``.

        ``b`` is the weight operand (``is_weight``) in fwd and dgrad. No capability checks
        here: callers run :func:`check_supported` once, up front.
        """

    def error_gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        """:meth:`gemm` for error measurement (the probe: a few calls at each of many shapes).
        A backend overrides it with a path of the same numerics that costs no compilation per new
        shape; by default it is :meth:`gemm`."""
        return self.gemm(a, b, choice, role)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}: {self.describe()}>"


#: ``(backend, choice, role, m, k, n) -> reason`` for every GEMM that a backend declared
#: unsupported at its real shape at run time (:meth:`Backend.runtime_reason`) and that
#: therefore ran in bf16. Cleared by nobody: a run's record of what it fell back on.
SHAPE_FALLBACKS: dict[tuple[str, str, str, int, int, int], str] = {}

_B = TypeVar("_B", bound=type[Backend])
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")  # as GemmChoice.backend

_REGISTRY: dict[str, type[Backend]] = {}
_INSTANCES: dict[str, Backend] = {}

#: name -> (module defining it, install hint). Consulted by :func:`get_backend` for names not
#: registered yet; extend with :func:`register_lazy_backend`.
LAZY_BACKENDS: dict[str, tuple[str, str]] = {
    "emulated": ("loka_tune.kernels.emulated", "nothing: it is part of loka-tune"),
    "torch_scaled_mm": (
        "loka_tune.kernels.backends.scaled_mm",
        "a CUDA build of torch>=2.5 (torch._scaled_mm)",
    ),
    "fbgemm": ("loka_tune.kernels.backends.fbgemm", "fbgemm-gpu-genai (`pip install fbgemm-gpu-genai`)"),
    "triton": ("loka_tune.kernels.backends.triton_backend", "triton (`pip install triton`)"),
    "torchao": ("loka_tune.kernels.backends.torchao_backend", "torchao (`pip install torchao`)"),
}


def register_backend(name: str, *, override: bool = False) -> Callable[[_B], _B]:
    """Class decorator: register a :class:`Backend` subclass under ``name``.

    Registering a different class under a taken name raises :class:`BackendError` unless
    ``override=True`` (re-registering the same class, e.g. on module reload, is fine).
    """

    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise BackendError(
            f"got backend name {name!r}; a backend name is lower-case letters, digits and '_',"
            " starting with a letter (it appears in choice ids such as 'e4m3.row.<backend>')"
        )

    def deco(cls: _B) -> _B:
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise TypeError(f"@register_backend({name!r}) decorates Backend subclasses, got {cls!r}")
        prev = _REGISTRY.get(name)
        if prev is not None and not override and prev.__qualname__ != cls.__qualname__:
            raise BackendError(
                f"backend name {name!r} is already registered by {prev.__module__}.{prev.__qualname__};"
                " pick another name or pass override=True"
            )
        cls.name = name
        _REGISTRY[name] = cls
        _INSTANCES.pop(name, None)
        return cls

    return deco


def unregister_backend(name: str) -> None:
    """Forget backend ``name`` (registered class, instance and lazy entry); for tests and plugins."""
    _REGISTRY.pop(name, None)
    _INSTANCES.pop(name, None)
    LAZY_BACKENDS.pop(name, None)


def register_lazy_backend(name: str, module: str, install_hint: str = "") -> None:
    """Declare that importing ``module`` registers backend ``name`` (imported on first use)."""
    LAZY_BACKENDS[name] = (module, install_hint)


def list_backends(*, available_only: bool = False) -> list[str]:
    """Names of all backends, registered or lazily declared (sorted).

    ``available_only=True`` imports the lazy ones and keeps those that import cleanly
    (it does not check devices: see :meth:`Backend.supports`).
    """
    names = sorted(set(_REGISTRY) | set(LAZY_BACKENDS))
    if not available_only:
        return names
    out = []
    for n in names:
        try:
            get_backend(n)
        except BackendError:
            continue
        out.append(n)
    return out


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (one shared instance), importing it lazily if needed.

    Raises :class:`BackendError` for an unknown name (listing the known ones) or a backend
    whose module cannot be imported (saying what to install).
    """
    inst = _INSTANCES.get(name)
    if inst is not None:
        return inst
    if name not in _REGISTRY and name in LAZY_BACKENDS:
        module, hint = LAZY_BACKENDS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing = getattr(e, "name", None) or ""
            if missing and (module == missing or module.startswith(missing + ".")):
                raise BackendError(
                    f"backend {name!r} is declared but its module {module} is not in this loka-tune"
                    f" installation ({e}); update loka-tune or choose another backend"
                    f" ({', '.join(sorted(_REGISTRY))} are loaded)"
                ) from e
            raise BackendError(
                f"backend {name!r} is not available: importing {module} failed ({e});"
                f" it needs {hint or 'its optional dependencies'}"
            ) from e
        if name not in _REGISTRY:
            raise BackendError(f"importing {module} did not register backend {name!r} (a bug in that module)")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise BackendError(
            f"unknown backend {name!r}; known backends: {', '.join(list_backends())}"
        )
    inst = cls()
    _INSTANCES[name] = inst
    return inst


def check_supported(
    choice: GemmChoice | str,
    role: GemmRole | str,
    device: str | torch.device | None = None,
    shape: Shape | None = None,
    *,
    site: str | None = None,
) -> None:
    """Raise :class:`UnsupportedChoiceError` unless ``choice``'s backend can run it here.

    The message names the site (if given), the choice, the reason and what the backend does
    support; an unknown or missing backend raises :class:`BackendError`.
    """
    choice = GemmChoice.parse(choice) if isinstance(choice, str) else choice
    role = GemmRole(role)
    backend = get_backend(choice.backend)
    reason = backend.supports(choice, role, device=device, shape=shape)
    if reason is None:
        return
    where = f"site {site!r}: " if site else ""
    raise UnsupportedChoiceError(
        f"{where}backend {backend.name!r} cannot run {choice.short_str()!r} for the {role.value} GEMM"
        f" on {device_type(device)!r}: {reason}. It supports {backend.describe()}."
        " Choose another choice or backend (the 'emulated' backend runs every FP8 choice on CPU and GPU),"
        " or apply with strict=False to fall back to bf16 for this GEMM."
    )


def _valid_formats(role: GemmRole) -> list[tuple[Format, Format]]:
    """Operand format pairs worth trying for ``role``: e5m2 only for the gradient operand A of
    dgrad and wgrad; mxfp8 for both or neither."""
    pairs = [(Format.E4M3, Format.E4M3), (Format.MXFP8, Format.MXFP8)]
    if role in (GemmRole.DGRAD, GemmRole.WGRAD):
        pairs.insert(1, (Format.E5M2, Format.E4M3))
    return pairs


def candidate_choices(
    backends: Sequence[str] | str = ("emulated",),
    *,
    formats: Iterable[Format | str] | None = None,
    granularities: Iterable[Granularity | str] | None = None,
    roles: Iterable[GemmRole | str] = ROLES,
    roundings: Iterable[ScaleRounding | str] | None = None,
    fast_accum: Iterable[bool] | None = None,
    device: str | torch.device | None = None,
    shape: Shape | None = None,
    include_bf16: bool = False,
) -> list[GemmChoice]:
    """FP8 choices the given backends can run for *every* role in ``roles`` (in a stable order).

    Format pairs: ``e4m3`` for both operands, ``mxfp8`` (granularity ``mx``) for both and, for
    dgrad and wgrad, ``e5m2`` for the gradient operand with an ``e4m3`` B. So ``roles=ROLES``
    (the default) never lists e5m2; ask per role (``roles=("wgrad",)``) for the full set.
    ``formats`` filters by the A operand's format. ``fast_accum=None`` uses each backend's
    ``enumerated_fast_accum``. ``device`` / ``shape`` (canonical ``(m, k, n)``; pass it only
    with a single role) filter through :meth:`Backend.supports`; without ``device`` a choice
    counts if the backend runs it on any of its devices. ``include_bf16`` puts the plain
    ``bf16`` choice first. Unknown or missing backends raise :class:`BackendError`.
    """
    if isinstance(backends, str):
        backends = (backends,)
    role_list = [GemmRole(r) for r in roles]
    fmt_filter = None if formats is None else {Format(f) for f in formats}
    gran_filter = None if granularities is None else {Granularity(g) for g in granularities}
    rnd = [ScaleRounding.EXACT, ScaleRounding.POW2] if roundings is None else [ScaleRounding(r) for r in roundings]
    out: list[GemmChoice] = [GemmChoice()] if include_bf16 else []
    seen = {c.short_str() for c in out}
    pairs: list[tuple[Format, Format]] = []
    for r in ROLES:  # role order, so e5m2 pairs come after e4m3 ones
        pairs += [p for p in _valid_formats(r) if p not in pairs]
    for name in backends:
        be = get_backend(name)
        fa_modes = be.enumerated_fast_accum if be.enumerated_fast_accum is not None else be.fast_accum_modes
        fas = list(fa_modes) if fast_accum is None else list(fast_accum)
        for (a, b), gran, rounding, fa in itertools.product(pairs, list(Granularity), rnd, fas):
            if a not in FP8_FORMATS or gran not in _FP8_GRANS:
                continue
            if fmt_filter is not None and a not in fmt_filter:
                continue
            if gran_filter is not None and gran not in gran_filter:
                continue
            if (a == Format.MXFP8) != (gran == Granularity.MX):
                continue
            if gran == Granularity.MX and rounding != ScaleRounding.POW2:
                continue  # mx scales are powers of two: 'exact' would duplicate it
            choice = GemmChoice(a, b, gran, rounding, fa, name)
            if choice.short_str() in seen:
                continue
            if not all((a, b) in _valid_formats(r) for r in role_list):
                continue
            devs = [device] if device is not None else sorted(be.devices)
            if not all(
                any(be.supports(choice, r, device=d, shape=shape) is None for d in devs) for r in role_list
            ):
                continue
            seen.add(choice.short_str())
            out.append(choice)
    return out


# The plain bf16 backend lives here; "emulated" registers lazily (LAZY_BACKENDS) from
# loka_tune.kernels.emulated, which imports this module.
@register_backend("bf16")
class BF16Backend(Backend):
    """A plain ``a @ b.T`` in the operands' dtype (torch's default accumulation), any device."""

    formats = frozenset({Format.BF16})
    granularities = frozenset({Granularity.NONE})
    install_hint = "nothing: it is plain torch"

    def gemm(self, a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, role: GemmRole) -> torch.Tensor:
        return a @ b.t()  # (m, k) @ (k, n) -> (m, n)
