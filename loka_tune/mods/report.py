"""What a Mods pass did: the modules it changed (before / after) and those it skipped (why).

Every pass returns a :class:`PassReport`; :func:`loka_tune.mods.apply_mods` returns a
:class:`ModsReport` gathering them in pass order. Both print as a readable summary
(``str(report)``) and serialize to plain JSON-able data (``report.to_dict()``) for MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loka_tune.config import ModsConfig

__all__ = ["Change", "Skip", "PassReport", "ModsReport"]

_MAX_LINES = 25  # per list in __str__; to_dict() always has everything


@dataclass(frozen=True)
class Change:
    """One module the pass changed.

    ``module`` is its fully qualified name (the first one where the same module object is
    registered under several names; the others are in ``aliases``), ``kind`` its class name
    before the change, ``before`` / ``after`` short descriptions.
    """

    module: str
    kind: str
    before: str
    after: str
    aliases: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"module": self.module, "kind": self.kind, "before": self.before, "after": self.after}
        if self.aliases:
            d["aliases"] = list(self.aliases)
        return d


@dataclass(frozen=True)
class Skip:
    """One module the pass looked at and left alone, and why."""

    module: str
    kind: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "kind": self.kind, "reason": self.reason}


@dataclass
class PassReport:
    """The result of one Mods pass over a model.

    ``params`` are the pass's arguments as used (e.g. the resolved prediction head),
    ``notes`` the choices that apply to every change (e.g. "affine parameters dropped").
    """

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    changed: list[Change] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def n_changed(self) -> int:
        return len(self.changed)

    @property
    def changed_modules(self) -> list[str]:
        """Names of the changed modules (first names; aliases not repeated)."""
        return [c.module for c in self.changed]

    @property
    def skipped_modules(self) -> dict[str, str]:
        """Skipped module name -> reason."""
        return {s.module: s.reason for s in self.skipped}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": dict(self.params),
            "n_changed": self.n_changed,
            "n_skipped": len(self.skipped),
            "changed": [c.to_dict() for c in self.changed],
            "skipped": [s.to_dict() for s in self.skipped],
            "notes": list(self.notes),
        }

    def headline(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args}): {self.n_changed} changed, {len(self.skipped)} skipped"

    def __str__(self) -> str:
        lines = [self.headline()]
        lines += [f"  note: {n}" for n in self.notes]
        for c in self.changed[:_MAX_LINES]:
            alias = f" (also {', '.join(c.aliases)})" if c.aliases else ""
            lines.append(f"  ~ {c.module or '<root>'}{alias}: {c.before} -> {c.after}")
        if len(self.changed) > _MAX_LINES:
            lines.append(f"  ~ ... and {len(self.changed) - _MAX_LINES} more changed")
        for s in self.skipped[:_MAX_LINES]:
            lines.append(f"  - {s.module or '<root>'} [{s.kind}]: {s.reason}")
        if len(self.skipped) > _MAX_LINES:
            lines.append(f"  - ... and {len(self.skipped) - _MAX_LINES} more skipped")
        return "\n".join(lines)


@dataclass
class ModsReport:
    """The passes :func:`~loka_tune.mods.apply_mods` ran, in order, for one :class:`ModsConfig`."""

    mods: ModsConfig
    passes: list[PassReport] = field(default_factory=list)

    @property
    def n_changed(self) -> int:
        return sum(p.n_changed for p in self.passes)

    @property
    def pass_names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __getitem__(self, name: str) -> PassReport:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass {name!r} ran; passes run: {self.pass_names}")

    def __contains__(self, name: object) -> bool:
        return any(p.name == name for p in self.passes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mods": self.mods.to_dict(),
            "short": self.mods.short_str(),
            "n_changed": self.n_changed,
            "passes": [p.to_dict() for p in self.passes],
        }

    def summary(self) -> dict[str, int]:
        """Flat counts for metrics logging: ``{"<pass>.changed": n, "<pass>.skipped": m}``."""
        out: dict[str, int] = {}
        for p in self.passes:
            out[f"{p.name}.changed"] = p.n_changed
            out[f"{p.name}.skipped"] = len(p.skipped)
        return out

    def __str__(self) -> str:
        if not self.passes:
            return f"Mods {self.mods.short_str()}: no pass enabled"
        head = f"Mods {self.mods.short_str()}: {self.n_changed} module(s) changed by {len(self.passes)} pass(es)"
        return "\n".join([head, *(str(p) for p in self.passes)])
