"""Typed, validated reading of client settings.

A client's setting is looked up first in the message's ConfigRecord (what the strategy
asked for this round), then in the run config (``[tool.flwr.app.config]`` or
``--run-config``), then a default. Every value is checked and a bad one raises a
ValueError naming the key and the allowed range.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowerdro.settings import _as_bool


class Settings:
    """Layered lookup: message config over run config over defaults."""

    def __init__(self, *layers: Mapping[str, Any]) -> None:
        self._layers = [dict(layer) for layer in layers if layer is not None]

    def raw(self, key: str, default: Any = None) -> Any:
        """First value found for ``key`` (message config first)."""
        for layer in self._layers:
            if key in layer and layer[key] is not None and layer[key] != "":
                return layer[key]
        return default

    def first_layer(self, *keys: str) -> Settings:
        """The first layer (message config first) that sets any of ``keys``; empty when none does.

        Keys that decide together (``local-steps`` / ``local-epochs``) are read from one
        layer, so a run config's ``local-epochs`` never overrides a message's ``local-steps``.
        """
        for layer in self._layers:
            if any(k in layer and layer[k] is not None and layer[k] != "" for k in keys):
                return Settings(layer)
        return Settings()

    def has(self, key: str) -> bool:
        """Whether any layer sets ``key``."""
        return self.raw(key) is not None

    def int(self, key: str, default: int, *, minimum: int | None = None) -> int:
        """Integer setting, at least ``minimum``."""
        value = self.raw(key, default)
        try:
            out = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: expected an integer, got {value!r}") from None
        if isinstance(value, float) and value != out:
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        if minimum is not None and out < minimum:
            raise ValueError(f"{key}: must be >= {minimum}, got {out}")
        return out

    def float(
        self,
        key: str,
        default: float,
        *,
        minimum: float | None = None,
        positive: bool = False,
        maximum: float | None = None,
    ) -> float:
        """Float setting; ``positive`` demands > 0, ``minimum``/``maximum`` are inclusive."""
        value = self.raw(key, default)
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
        if out != out:
            raise ValueError(f"{key}: expected a number, got NaN")
        if positive and not out > 0:
            raise ValueError(f"{key}: must be > 0, got {out}")
        if minimum is not None and out < minimum:
            raise ValueError(f"{key}: must be >= {minimum}, got {out}")
        if maximum is not None and out > maximum:
            raise ValueError(f"{key}: must be <= {maximum}, got {out}")
        return out

    def str(self, key: str, default: str, *, choices: tuple[str, ...] | None = None) -> str:
        """String setting, one of ``choices`` when given."""
        out = str(self.raw(key, default))
        if choices is not None and out not in choices:
            raise ValueError(f"{key}: unknown value {out!r}; allowed: {', '.join(choices)}")
        return out

    def bool(self, key: str, default: bool) -> bool:
        """Boolean setting (accepts true/false, 1/0, yes/no, on/off), read as the server's settings read it."""
        return _as_bool(key, self.raw(key, default))

    def int_list(self, key: str) -> tuple[int, ...]:
        """Comma-separated integers such as ``"0,3,7"`` (empty when unset)."""
        value = self.raw(key, "")
        if isinstance(value, int):
            return (value,)
        items = [v.strip() for v in str(value).split(",") if v.strip()]
        try:
            return tuple(int(v) for v in items)
        except ValueError:
            raise ValueError(f"{key}: expected comma-separated integers, got {value!r}") from None
