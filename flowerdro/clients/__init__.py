"""Client side: local training loops (``training``), message handlers (``handlers``) and the
toolkit that serves every strategy with a project's own model, data and training (``kit``)."""

from flowerdro.clients.kit import ROUTES, ClientKit, TrainArgs, add_routes

__all__ = ["ROUTES", "ClientKit", "TrainArgs", "add_routes"]
