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

The routes are registered from that one table, which :class:`~flowerdro.clients.kit.ClientKit`
also serves with a user's own model and data; an algorithm's new message type is one line
there.
"""

from __future__ import annotations

from flwr.clientapp import ClientApp

from flowerdro.clients.kit import ROUTES

app = ClientApp()

for _type, _handler in ROUTES.items():
    _category, _, _action = _type.partition(".")
    getattr(app, _category)(_action or "default")(_handler)
