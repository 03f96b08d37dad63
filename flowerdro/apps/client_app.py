"""The flowerdro ClientApp: routes message types to :mod:`flowerdro.clients.handlers`.

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
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flowerdro.clients import handlers

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Plain local training (Flower's built-in strategies send ``train``)."""
    return handlers.train_reply(msg, context)


@app.train("sgd")
def train_sgd(msg: Message, context: Context) -> Message:
    """Local SGD for the FedMGDA+ family."""
    return handlers.train_reply(msg, context)


@app.train("drfa")
def train_drfa(msg: Message, context: Context) -> Message:
    """DRFA local steps: final model plus the snapshot after step t′."""
    return handlers.train_reply(msg, context, with_snapshot=True)


@app.train("drdsgd")
def train_drdsgd(msg: Message, context: Context) -> Message:
    """DR-DSGD local step θ_i − η (h_i/μ) g_i from the node's own model."""
    from flowerdro.clients.drdsgd import drdsgd_reply

    return drdsgd_reply(msg, context, robust=True)


@app.train("dsgd")
def train_dsgd(msg: Message, context: Context) -> Message:
    """DSGD local step θ_i − η g_i from the node's own model."""
    from flowerdro.clients.drdsgd import drdsgd_reply

    return drdsgd_reply(msg, context, robust=False)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy on the client's own test set."""
    return handlers.evaluate_reply(msg, context)


@app.query("loss")
def query_loss(msg: Message, context: Context) -> Message:
    """Loss of the received model on one minibatch or all local training data."""
    return handlers.loss_reply(msg, context)


@app.query("init")
def query_init(msg: Message, context: Context) -> Message:
    """Seeded initial model weights."""
    return handlers.init_reply(msg, context)


@app.query("loss_grad")
def query_loss_grad(msg: Message, context: Context) -> Message:
    """SCAFF-PD phase 1: loss and gradient at the received model (c_i kept in state)."""
    from flowerdro.clients.scaffpd import loss_grad_reply

    return loss_grad_reply(msg, context)


@app.train("scaffpd")
def train_scaffpd(msg: Message, context: Context) -> Message:
    """SCAFF-PD phase 2: bias-corrected local steps with the received control c."""
    from flowerdro.clients.scaffpd import scaffpd_train_reply

    return scaffpd_train_reply(msg, context)


@app.train("scaffold")
def train_scaffold(msg: Message, context: Context) -> Message:
    """SCAFFOLD local steps with control variates; reply model and control delta."""
    from flowerdro.clients.scaffpd import scaffold_train_reply

    return scaffold_train_reply(msg, context)


@app.train("fedrobust")
def train_fedrobust(msg: Message, context: Context) -> Message:
    """FedRobust: τ steps of descent on w and ascent on the node's (Λ_i, δ_i) (kept in state)."""
    from flowerdro.clients.robust import fedrobust_train_reply

    return fedrobust_train_reply(msg, context)


@app.train("fgm")
def train_fgm(msg: Message, context: Context) -> Message:
    """Distributed FGM adversarial training: local SGD on ℓ₂ one-step attacks of radius ε."""
    from flowerdro.clients.robust import adversarial_train_reply

    return adversarial_train_reply(msg, context, "fgm")


@app.train("pgd")
def train_pgd(msg: Message, context: Context) -> Message:
    """Distributed PGD adversarial training: local SGD on K-step ℓ₂ PGD attacks of radius ε."""
    from flowerdro.clients.robust import adversarial_train_reply

    return adversarial_train_reply(msg, context, "pgd")


@app.query("affine_state")
def query_affine_state(msg: Message, context: Context) -> Message:
    """FedRobust state read-back: ‖Λ_i − I‖_F and ‖δ_i‖₂ of this node."""
    from flowerdro.clients.robust import affine_state_reply

    return affine_state_reply(msg, context)
