"""The flowerdro ClientApp: every message type of :data:`flowerdro.clients.kit.ROUTES`, routed to its handler.

| message type   | handler                                    | used by                         |
|----------------|--------------------------------------------|---------------------------------|
| ``train``      | local SGD, reply ``arrays`` + metrics      | FedAvg, FedProx, q-FedAvg       |
| ``train.sgd``  | same                                       | FedMGDA+ family                 |
| ``train.drfa`` | local SGD + model after step t′ (snapshot) | DRFA, DRFA-Prox, AFL            |
| ``train.drdsgd`` | one tilted SGD step (h/μ) from the node's own θ_i | DR-DSGD               |
| ``train.dsgd`` | one plain SGD step from the node's own θ_i | DSGD                            |
| ``evaluate``   | test loss/accuracy on the client's own test set | every strategy             |
| ``query.loss`` | loss at the received model (batch or full) | DRFA, AFL, FedMGDA+ fairness    |
| ``query.init`` | seeded initial model                       | the ServerApp (no data needed)  |
| ``query.loss_grad`` | loss f_i(x) and gradient c_i (kept in state) | SCAFF-PD phase 1          |
| ``train.scaffpd`` | J steps of u − η(g_i(u) − c_i + c), reply u_J | SCAFF-PD phase 2           |
| ``train.scaffold`` | corrected local steps, option-II c_i update | SCAFFOLD                    |
| ``train.fedrobust`` | τ steps: descent on w, ascent on the received (Λ_i, δ_i) | FedRobust  |
| ``train.fgm`` / ``train.pgd`` | local SGD on ℓ₂ FGM / PGD adversarial batches | FGM / PGD training |
| ``query.affine_state`` | the node's partition id and input dimension d | FedRobust        |

The routes are registered from :data:`flowerdro.clients.routes.ROUTE_SPECS`, which
:class:`~flowerdro.clients.kit.ClientKit` also serves with a user's own model and data; an
algorithm's new message type is one line there. Importing this module loads neither torch
nor the data code (Flower 1.41 starts a new process for every message): a handler's module
is imported on its first call. With ``worker=1`` in the node config the message is served
by the node's long-lived worker process instead (:mod:`flowerdro.deploy.worker`). A training
message that carries the clipping norm of a client-side DP wrapper is clipped by Flower's
matching mod (:func:`flowerdro.clients.mods.clip_as_asked`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flowerdro.clients.mods import ModChain, ReportMods
from flowerdro.clients.routes import ROUTE_SPECS, handler
from flowerdro.legacy_wire import FromLegacy


def serve(message: Message, context: Context) -> Message:
    """Reply to ``message``: through the node's worker when the node config enables one, else here."""
    from flowerdro.deploy.worker import forward, worker_settings

    settings = worker_settings(context.node_config)
    if settings.enabled:
        reply = forward(message, context, settings)
        if reply is not None:
            return reply
    return handler(message.metadata.message_type)(message, context)


def client_app(mods: Sequence[Any] | None = None) -> ClientApp:
    """flowerdro's ClientApp, with Flower ``mods`` as ``ClientApp(mods=...)`` takes them.

    Mods that act on a training reply's model (Flower's clipping mods, ``LocalDpMod``,
    ``secaggplus_mod``) wrap the training routes only, and the ``query.init`` reply names
    the mods for the server's checks (:class:`~flowerdro.clients.mods.ModChain`). A
    training route without a clipping mod clips when the server's client-side DP wrapper
    asks (:func:`~flowerdro.clients.mods.clip_as_asked`).
    """
    chain = ModChain(list(mods or []))
    out = ClientApp()
    for mtype in ROUTE_SPECS:
        category, _, action = mtype.partition(".")
        route: Any = serve
        if mtype == "query.init":
            route = ReportMods(serve, chain)
        elif mtype in ("train", "evaluate"):  # also a LegacyStrategy's FitIns / EvaluateIns
            route = FromLegacy(serve, serve_any)
        getattr(out, category)(action or "default", mods=chain.for_type(mtype))(route)
    return out


def serve_any(message_type: str) -> Any:
    """The handler of any flowerdro message type: :func:`serve` (it routes by the message's type)."""
    return serve


app = client_app()
