"""Client side: local training loops (``training``), message handlers (``handlers``) and the
toolkit that serves every strategy with a project's own model, data and training (``kit``)."""

from typing import Any

__all__ = ["ROUTES", "ClientKit", "TrainArgs", "add_routes"]


def __getattr__(name: str) -> Any:
    """The kit's names, imported on first use (``flowerdro.clients.routes`` needs no torch)."""
    if name in __all__:
        from flowerdro.clients import kit

        return getattr(kit, name)
    raise AttributeError(f"module 'flowerdro.clients' has no attribute {name!r}")
