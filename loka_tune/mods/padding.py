"""Pad linear layers' K and N to a multiple (e.g. 16) so that FP8 kernels accept them.

Scheme (the simplest exact one): :class:`PaddedLinear` wraps an ``nn.Linear(K_pad, N_pad)``
child named ``linear`` whose weight holds the original ``(N, K)`` weight in its top-left
corner and zeros elsewhere (bias: the original ``N`` values, then zeros). Its forward
zero-pads the input's last dim from K to K_pad, runs the padded linear, and slices the output
back to N (made contiguous, so any downstream ``view`` still works)::

    Y = linear(pad(X, K_pad))[..., :N]

Exactness. Output: the extra K columns of W meet exact zeros of the input, and the extra N
rows only produce columns that are sliced away, so Y equals the unpadded layer's output
(up to the summation order of the GEMM). Gradients: dX is the first K columns of
``dY_pad @ W_pad`` where dY_pad is dY followed by zeros, i.e. ``dY @ W``; dW_pad is
``dY_pad^T X_pad``, whose real block is ``dY^T X`` and whose padding block is **exactly
zero** (a product with exact zeros), likewise the bias gradient.

Why the padding stays zero during training. Its gradient is exactly zero at every step. For
an optimizer that updates each coordinate from that coordinate's own value and gradient
history (SGD with momentum / Nesterov / weight decay, Adam, AdamW, Adagrad, RMSprop, Adamax,
NAdam, RAdam: every ``torch.optim`` optimizer but LBFGS), a coordinate that is 0 with an
all-zero gradient history stays exactly 0: its moments are 0, ``wd * 0 = 0``, and Adam's
step is ``0 / (sqrt(0) + eps) = 0``. This is tested. For anything else (optimizers mixing
coordinates such as Shampoo or Muon, a re-initialisation, a foreign state dict), call
:func:`rezero_padding_` after the step; :func:`padding_violations` checks. Note that only
FP8 scales care: with finite values in the padding the output is still exact, but a nonzero
padding would change a quantized GEMM's amax.

State dict. A padded model's state dict differs: ``<name>.weight`` (N, K) becomes
``<name>.linear.weight`` (N_pad, K_pad) and likewise the bias. :func:`unpad` turns every
``PaddedLinear`` back into a plain ``nn.Linear`` with the original shapes and keys (for export
or to load an unpadded checkpoint). Apply :func:`pad` before building the optimizer, and
before the precision swap (``loka_tune.applier`` runs Mods first): the precision swap then
finds the padded GEMM as the site ``<name>.linear``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loka_tune.errors import ModError
from loka_tune.mods._walk import (
    Walk,
    check_model,
    find_prediction_head,
    has_hooks,
    is_parametrized,
    is_uninitialized_lazy,
    overrides_forward,
    param_owner_count,
    resolve_names,
)
from loka_tune.mods.report import Change, PassReport, Skip

__all__ = ["PaddedLinear", "pad", "unpad", "rezero_padding_", "padding_violations", "round_up"]


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


def _check_multiple(multiple: object) -> int:
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple <= 0:
        raise ModError(f"pad multiple must be a positive integer (FP8 kernels want 16); got {multiple!r}")
    return multiple


class PaddedLinear(nn.Module):
    """A linear layer ``K -> N`` computed by a zero-padded ``nn.Linear(K_pad, N_pad)``.

    ``in_features`` / ``out_features`` are the logical K and N; the child ``linear`` holds the
    padded parameters (``padded_in`` x ``padded_out``). ``weight`` / ``bias`` are views of the
    real region (logical shapes). See the module docstring for exactness, why the padding
    stays zero under training, and the state dict.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        multiple: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_multiple(multiple)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.multiple = multiple
        self.linear = nn.Linear(
            round_up(self.in_features, multiple), round_up(self.out_features, multiple), bias=bias,
            device=device, dtype=dtype,
        )
        self.reset_parameters()

    @property
    def padded_in(self) -> int:
        return self.linear.in_features

    @property
    def padded_out(self) -> int:
        return self.linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The real ``(N, K)`` block of the padded weight (a view)."""
        return self.linear.weight[: self.out_features, : self.in_features]

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.linear.bias
        return None if b is None else b[: self.out_features]

    def reset_parameters(self) -> None:
        """Initialise like ``nn.Linear(K, N)`` (fan-in K, not K_pad), padding zero."""
        w, b = self.linear.weight, self.linear.bias
        if w.device.type == "meta":
            return
        real_w = torch.empty(self.out_features, self.in_features, device=w.device, dtype=w.dtype)
        nn.init.kaiming_uniform_(real_w, a=math.sqrt(5))
        with torch.no_grad():
            w.zero_()
            w[: self.out_features, : self.in_features].copy_(real_w)
            if b is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
                b.zero_()
                b[: self.out_features].uniform_(-bound, bound)

    @classmethod
    def from_linear(cls, lin: nn.Linear, multiple: int = 16) -> "PaddedLinear":
        """A padded copy of ``lin`` (same values, dtype, device, ``requires_grad``)."""
        w = lin.weight
        out = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, multiple=multiple,
                  device="meta", dtype=w.dtype)
        out.linear = nn.Linear(out.padded_in, out.padded_out, bias=lin.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.linear.weight.zero_()
            out.linear.weight[: lin.out_features, : lin.in_features].copy_(w)
            if lin.bias is not None:
                out.linear.bias.zero_()
                out.linear.bias[: lin.out_features].copy_(lin.bias)
        out.linear.weight.requires_grad_(w.requires_grad)
        if lin.bias is not None:
            out.linear.bias.requires_grad_(lin.bias.requires_grad)
        out.train(lin.training)
        return out

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear(K, N)`` with the real block of the weights (copies)."""
        w = self.linear.weight
        lin = nn.Linear(self.in_features, self.out_features, bias=self.linear.bias is not None,
                        device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight)
            bias = self.bias
            if bias is not None:  # exactly when lin has a bias
                lin.bias.copy_(bias)
        lin.weight.requires_grad_(w.requires_grad)
        lin.train(self.training)
        return lin

    def padding_is_zero(self) -> bool:
        w, b = self.linear.weight, self.linear.bias
        n, k = self.out_features, self.in_features
        ok = bool((w[n:] == 0).all()) and bool((w[:n, k:] == 0).all())
        return ok and (b is None or bool((b[n:] == 0).all()))

    def rezero_(self) -> None:
        """Set the padding region of the weight and bias back to zero (in place)."""
        n, k = self.out_features, self.in_features
        with torch.no_grad():
            self.linear.weight[n:].zero_()
            self.linear.weight[:n, k:].zero_()
            if self.linear.bias is not None:
                self.linear.bias[n:].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        if x.shape[-1] != k:
            raise RuntimeError(
                f"PaddedLinear({k} -> {n}) got an input whose last dim is {x.shape[-1]}, expected {k}"
            )
        if self.padded_in != k:
            x = F.pad(x, (0, self.padded_in - k))  # (..., K_pad), zeros on the right
        y = self.linear(x)  # (..., N_pad)
        if self.padded_out != n:
            y = y[..., :n].contiguous()  # (..., N)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"padded=({self.padded_in}, {self.padded_out}), multiple={self.multiple}"
        )


def _linear_desc(k: int, n: int) -> str:
    return f"K={k}, N={n}"


def pad(model: nn.Module, multiple: int = 16, *, skip: tuple[str, ...] | list[str] | None = None) -> PassReport:
    """Wrap every ``nn.Linear`` whose K or N is not a multiple of ``multiple`` in a
    :class:`PaddedLinear` (numerically exact; see the module docstring).

    ``skip`` names modules to leave alone (every linear under them); ``None`` (default) skips
    the prediction head (found like :func:`~loka_tune.mods.no_bias` does: its N = 1 GEMM is
    kept in high precision by the precision configs, so padding it to 16 would only add
    work). Layers already aligned are untouched. Skipped and reported: subclasses of
    ``nn.Linear`` with their own ``forward`` (e.g. an already precision-swapped ``LokaLinear``:
    apply Mods first), linears inside ``nn.MultiheadAttention``, lazy, parametrized or
    hooked linears, and linears whose weight is tied to another module. Idempotent; a model
    padded to another multiple is re-padded from its original shapes.

    The state dict changes (``<name>.weight`` -> ``<name>.linear.weight``, padded); see
    :func:`unpad`. Apply before building the optimizer.
    """
    check_model(model)
    _check_multiple(multiple)
    if skip is None:
        head, how = find_prediction_head(model)
        skip_names: tuple[str, ...] = () if head is None else (head,)
        why = f"the prediction head ({how}): kept unpadded"
    else:
        skip_names = (skip,) if isinstance(skip, str) else tuple(skip)
        why = "named in skip"
    report = PassReport("pad", params={"multiple": multiple, "skip": list(skip_names)})
    report.notes.append("state dict keys change: <name>.weight -> <name>.linear.weight (padded); unpad() reverts")

    skipped_ids: dict[int, str] = {}
    for name, mod in zip(skip_names, resolve_names(model, skip_names, what="pad skip")):
        for m in mod.modules():
            if isinstance(m, (nn.Linear, PaddedLinear)):
                skipped_ids.setdefault(id(m), f"{why} ({name!r})" if skip is not None else why)
    owners = param_owner_count(model)

    tree = Walk(model)
    for site in tree:
        m = site.module
        parent = site.parent
        if isinstance(parent, PaddedLinear) and parent.linear is m:
            continue  # handled through its wrapper
        if isinstance(m, PaddedLinear):
            if id(m) in skipped_ids:
                report.skipped.append(Skip(site.name, site.kind, skipped_ids[id(m)]))
            elif m.padded_in % multiple == 0 and m.padded_out % multiple == 0:
                report.skipped.append(
                    Skip(site.name, site.kind, f"already padded: K {m.in_features}->{m.padded_in}, "
                         f"N {m.out_features}->{m.padded_out}")
                )
            elif type(m.linear) is not nn.Linear or has_hooks(m) or has_hooks(m.linear):
                report.skipped.append(
                    Skip(site.name, site.kind, f"padded to another multiple ({m.multiple}) and its inner linear"
                         " is swapped or hooked: unpad() first")
                )
            else:
                new = PaddedLinear.from_linear(m.to_linear(), multiple)
                tree.replace(site, new)
                report.changed.append(
                    Change(site.name, site.kind,
                           f"{_linear_desc(m.in_features, m.out_features)} padded to ({m.padded_in}, {m.padded_out})",
                           f"padded to ({new.padded_in}, {new.padded_out})", site.aliases)
                )
            continue
        if not isinstance(m, nn.Linear):
            continue
        k, n = m.in_features, m.out_features
        if id(m) in skipped_ids:
            reason = skipped_ids[id(m)]
        elif isinstance(parent, nn.MultiheadAttention):
            reason = "inside nn.MultiheadAttention, which reads the projection tensors directly"
        elif is_uninitialized_lazy(m):
            reason = "uninitialized lazy module: run one forward pass first"
        elif overrides_forward(m, nn.Linear):
            reason = (f"{site.kind} has its own forward (a precision wrapper such as LokaLinear?):"
                      " apply Mods before the precision swap")
        elif k % multiple == 0 and n % multiple == 0:
            reason = f"already aligned ({_linear_desc(k, n)})"
        elif is_parametrized(m):
            reason = "parametrized (torch.nn.utils.parametrize)"
        elif has_hooks(m):
            reason = "has hooks attached (a probe, a profiler?): apply Mods before attaching hooks"
        elif any(owners.get(id(p), 1) > 1 for p in m._parameters.values() if p is not None):
            reason = "its weight or bias is tied to another module"
        elif site.name == "":
            reason = "the model itself is the linear: wrap it in a container to pad it"
        else:
            reason = None
        if reason is not None:
            report.skipped.append(Skip(site.name, site.kind, reason))
            continue
        new = PaddedLinear.from_linear(m, multiple)
        tree.replace(site, new)
        report.changed.append(
            Change(site.name, site.kind, _linear_desc(k, n),
                   f"PaddedLinear(K={k}->{new.padded_in}, N={n}->{new.padded_out})", site.aliases)
        )
    return report


def unpad(model: nn.Module) -> PassReport:
    """Replace every :class:`PaddedLinear` with the equivalent plain ``nn.Linear(K, N)``.

    Reverts :func:`pad` (state dict keys and shapes back to the original). A padded layer
    whose inner linear was swapped (e.g. to a ``LokaLinear``) or hooked is skipped. Exact:
    the dropped padding never reaches the output.
    """
    check_model(model)
    report = PassReport("unpad")
    tree = Walk(model)
    for site in tree:
        m = site.module
        if not isinstance(m, PaddedLinear):
            continue
        if type(m.linear) is not nn.Linear or has_hooks(m) or has_hooks(m.linear):
            report.skipped.append(Skip(site.name, site.kind, "its inner linear is swapped or hooked"))
            continue
        if site.name == "":
            report.skipped.append(Skip(site.name, site.kind, "the model itself: call .to_linear()"))
            continue
        nonzero = not m.padding_is_zero()
        tree.replace(site, m.to_linear())
        report.changed.append(
            Change(site.name, site.kind, f"padded ({m.padded_in}, {m.padded_out})",
                   f"Linear(K={m.in_features}, N={m.out_features})" + (" (nonzero padding dropped)" if nonzero else ""),
                   site.aliases)
        )
    return report


def padding_violations(model: nn.Module) -> list[str]:
    """Names of the :class:`PaddedLinear` layers whose padding is not all zeros."""
    return [n for n, m in model.named_modules() if isinstance(m, PaddedLinear) and not m.padding_is_zero()]


def rezero_padding_(model: nn.Module) -> int:
    """Zero the padding of every :class:`PaddedLinear` (e.g. after an optimizer step that mixes
    coordinates); returns the number of padded layers."""
    count = 0
    for m in model.modules():
        if isinstance(m, PaddedLinear):
            m.rezero_()
            count += 1
    return count
