"""The tiny measured-speed DLRM study several CPU tests of the tuner build on (regime,
confirmation, compile cache, the compiled probe): one text, varied per test by its sections."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["tiny_measured_study"]

_TRAINING = {"steps": 12, "batch_size": 32, "window": 4, "warmup_steps": 1, "seeds": "[0, 1]", "device": '"cpu"'}
_OBJECTIVE = {"budget_pct": 1.0, "speed": '"measured"'}


def _table(name: str, base: Mapping[str, object], over: Mapping[str, object]) -> str:
    rows = {**base, **over}
    return f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in rows.items() if v is not None)


def tiny_measured_study(name: str, *, training: Mapping[str, object] | None = None,
                        objective: Mapping[str, object] | None = None, extra: str = "") -> str:
    """The study file's text: ``training`` / ``objective`` override (or, with ``None``, drop) keys
    of those tables (values as TOML literals); ``extra`` is appended (further tables)."""
    return (f'[study]\nname = "{name}"\n[model]\nname = "dlrm"\npreset = "tiny"\n[data]\nsource = "synthetic"\n'
            "[data.params]\nnum_dense = 4\ncardinalities = [50, 50]\neval_examples = 256\n"
            + _table("training", _TRAINING, training or {}) + _table("objective", _OBJECTIVE, objective or {})
            + extra)
