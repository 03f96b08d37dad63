"""The contract between flowerdro's server and its clients: names and client-side settings.

Both sides import this module (it needs neither torch nor flwr): the metric keys every
reply carries, and the settings of the clients' local work. The server reads
:class:`TrainingSettings` and :class:`NodeSettings` from the run config and validates them
before its first message, so a bad ``lr`` or ``malicious-ids`` fails the run at once
instead of turning every client reply into an error; it sends the training settings in
every training message. See docs/protocol.md for every message type.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowerdro.settings import Settings, setting

#: Metric keys of every reply.
NUM_EXAMPLES, PARTITION_ID = "num-examples", "partition-id"

#: Training-reply metric set to 1 by a client whose own ``train_fn`` ran the local loop (the kit).
USER_TRAIN_FN = "user-train-fn"

#: Reply metrics that say who answered and how, not what was measured: never averaged over clients.
IDENTIFIER_METRICS: tuple[str, ...] = (PARTITION_ID, USER_TRAIN_FN)

#: Training-message config key naming the clipping the server's client-side DP wrapper expects
#: (``"fixed"`` or ``"adaptive"``: which of Flower's clipping mods the client applies).
CLIPPING_KEY = "dp-clipping"

#: The ConfigRecord of a ``query.init`` reply in which a client says what it runs (``mods``:
#: the names of the Flower mods around its training routes).
CLIENT_RECORD = "client"

#: Model names the clients can build (``flowerdro.models``; a test keeps the two in line).
MODEL_NAMES: tuple[str, ...] = (
    "cnn_cifar10", "cnn_femnist", "cnn_fmnist", "cnn_mnist", "lenet", "linear", "logreg", "mlp",
)

#: Where the received model's loss ``train_loss`` is measured before local training.
TRAIN_LOSS_ON: tuple[str, ...] = ("full", "batch")

#: The data an ``evaluate`` message is answered on (run config or message config ``eval-split``):
#: the client's test set, or the validation set held out of its training data
#: (``validation-fraction`` > 0, or a ClientKit whose ``data_fn`` returns one).
EVAL_SPLITS: tuple[str, ...] = ("test", "validation")

#: Attacks of malicious clients (robustness experiments): ``bias`` adds ``attack-bias`` to
#: every loss reported; ``loss-scale`` trains on (and reports) s·f_i instead of f_i, the
#: scaling attack of FedMGDA+ §6.2.2 (Hu et al., arXiv:2006.11489); ``update-scale`` sends
#: w + s·(w_i − w) instead of w_i (equal to ``loss-scale`` only for one full-batch SGD step).
ATTACKS: tuple[str, ...] = ("none", "bias", "loss-scale", "update-scale")

#: The forms of run-config ``device`` (``cuda:N`` with N a CUDA device index ≥ 0).
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "cuda:N")


def check_device(value: object) -> str:
    """The run-config ``device`` as written, when it has one of the forms of :data:`DEVICES`.

    Only the form is checked here (the server has no view of its clients' hardware); a
    client refuses ``cuda`` or ``cuda:N`` that it lacks when it builds its runtime
    (:func:`flowerdro.clients.training.resolve_device`).

    Raises
    ------
    ValueError
        Naming the key ``device`` and the allowed forms.
    """
    text = str(value).strip() if isinstance(value, str) else None
    if text in ("auto", "cpu", "cuda"):
        return text
    if text is not None and text.startswith("cuda:") and text[5:].isdigit():
        return text
    raise ValueError(f"device: unknown value {value!r}; allowed: auto, cpu, cuda, cuda:N (N a CUDA device "
                     "index such as cuda:1)")


@dataclass(frozen=True)
class TrainingSettings(Settings):
    """The clients' local work, sent in every training message (the message's values win).

    A strategy whose algorithm defines the local work (DRFA's τ, SCAFF-PD's J, AFL's one
    step) sends ``local-steps`` without ``local-epochs``, and a client then never falls back
    to a ``local-epochs`` of its own run config: the first layer (message, then run
    config) that sets either key decides.
    """

    lr: float = setting(0.05, "η, the clients' SGD step size", gt=0)
    local_steps: int = setting(10, "τ, local SGD steps per round (unless local-epochs is set)", ge=1)
    local_epochs: float = setting(0.0, "local epochs per round instead of local-steps (0: use local-steps)", ge=0)
    batch_size: int = setting(32, "minibatch size of the local steps", ge=1)
    weight_decay: float = setting(0.0, "L2 penalty added to the local loss", ge=0)
    train_loss_on: str = setting("full", "where train_loss (the received model's loss) is measured: all "
                                         "local data or the first minibatch", choices=TRAIN_LOSS_ON)


@dataclass(frozen=True)
class NodeSettings(Settings):
    """What each client builds from the run config once: its model and its role in an attack."""

    model: str = setting("logreg", "the model the clients build", choices=MODEL_NAMES)
    hidden: tuple[int, ...] = setting((128, 64), "hidden layer sizes of the mlp", ge=1)
    precision: str = setting("float32", "dtype of the clients' data and model", choices=("float32", "float64"))
    device: str = setting("auto", "where the clients compute: auto (flowerdro's own loops on CUDA when available; "
                                  "a ClientKit's train/test functions get the model on the device of the tensors "
                                  "their loader yields), cpu (everything on the CPU), cuda or cuda:N (everything "
                                  "there; a client without that device refuses)", forms=", ".join(DEVICES))
    model_seed: int | None = setting(None, "seed of the initial weights (unset: seed)")
    threads: int = setting(1, "torch threads of a client process (0: torch's default, one per core); "
                              "with 1, results do not depend on the machine's core count", ge=0)
    malicious_ids: tuple[int, ...] = setting((), "partition ids of malicious clients", ge=0)
    attack: str = setting("none", "what malicious clients do: add attack-bias to every loss they report "
                                  "(bias), train on attack-scale times their loss (loss-scale, the FedMGDA+ "
                                  "paper's scaling attack) or multiply their update by attack-scale "
                                  "(update-scale)", choices=ATTACKS)
    attack_bias: float = setting(0.0, "the bias a bias attacker adds to its losses")
    attack_scale: float = setting(1.0, "the factor s of a scaling attacker (loss-scale: its loss, "
                                       "update-scale: its update)")
    eval_split: str = setting("test", "what the clients evaluate on: their test set, or the validation set held "
                                      "out of their training data (needs validation-fraction > 0; for tuning)",
                              choices=EVAL_SPLITS)

    def check(self) -> None:
        """``device`` must have one of the forms of :data:`DEVICES`."""
        check_device(self.device)

    def attack_record(self) -> dict[str, object]:
        """Which attack the run's malicious clients ran, for its results (empty when none did).

        ``{"attack", "malicious_ids", "attack_bias" | "attack_scale"}`` when ``malicious-ids``
        is set and ``attack`` is not ``none``; an honest run records nothing.
        """
        if not self.malicious_ids or self.attack == "none":
            return {}
        amount = {"attack_bias": self.attack_bias} if self.attack == "bias" else {"attack_scale": self.attack_scale}
        return {"attack": self.attack, "malicious_ids": list(self.malicious_ids), **amount}
