r"""Every flowerdro strategy with the user's own model, data, loss and training function.

A Flower project keeps its model, its data loading and its ``train``/``test`` functions
and hands them to a :class:`ClientKit`; the kit serves every message type of every
flowerdro strategy (see :data:`ROUTES`) through flowerdro's own handlers, which then
build *the user's* model from *the user's* data:

.. code-block:: python

    from flowerdro.clients import ClientKit, add_routes

    kit = ClientKit(model_fn=Net, data_fn=load_data, batch_keys=("img", "label"),
                    loss_fn=torch.nn.CrossEntropyLoss(), test_fn=test,
                    train_fn=lambda model, loader, a: train(model, loader, a.epochs, a.lr, a.device))
    app = kit.client_app()          # a new ClientApp, or add_routes(app, kit) on an existing one

What runs where:

* ``train`` and ``train.sgd`` (FedAvg, FedProx, q-FedAvg, the FedMGDA+ family) run the
  user's ``train_fn`` unchanged when one is given (:mod:`flowerdro.clients.userloop`):
  the kit first measures the received model's loss F_i(w) on the local training data
  (``train_loss``, what q-FedAvg and FedMGDA+ need) and reports the user's own return
  value as ``train_loss_local``. For FedProx (a message with ``proximal-mu`` μ > 0) it
  adds the proximal gradient μ (w − w⁰) to every parameter's gradient through tensor
  hooks, so the user's loop minimises f_i(w) + (μ/2)‖w − w⁰‖² without any change (one
  ``backward`` per optimizer step assumed).
* Every other message type is an algorithm that defines the local loop (DRFA's snapshot
  after step t′, SCAFFOLD and SCAFF-PD's corrected gradients, FedRobust's adversary,
  DR-DSGD's tilted step, FGM/PGD): flowerdro runs the paper's loop on the user's model
  with the user's minibatch loss ``loss_fn(model(x), y)``.

The user's data is read once per partition and run into tensors
(:mod:`flowerdro.clients.userdata`; the algorithm-defined loops draw seeded minibatches
from them); the user's own loaders still go to ``train_fn`` and ``test_fn``. What the kit
keeps for a node (its :class:`~flowerdro.clients.userruntime.UserRuntime`: the data, the
loaders) is keyed by the Flower run (``context.run_id``), so a second run in the same
process, a notebook's next experiment, reads the data again and sees nothing of the
first; within a run it is reused from message to message.

Validation data (an evaluate message with ``eval-split = "validation"``, the tuning
advisor's search): ``data_fn`` may return ``(train, validation, test)``, and the
validation part is then evaluated as the test part is (``test_fn`` on the validation
loader). With ``(train, test)`` and run config ``validation-fraction`` v > 0 the kit holds
out a stratified v of the training tensors itself (seeded by ``data-seed``, else ``seed``),
but only where nothing of the user's reads the training loader or evaluates a loader: with
a ``train_fn`` or a ``test_fn`` it refuses and asks for ``(train, validation, test)``, since
the user's loader would still hold the validation rows. ``partition-id`` in the node config
is optional: without it the node's id stands for the partition (the server does the same),
and ``data_fn`` is called with ``(node_id, 0)``.

Where things run (run-config ``device``, or ``ClientKit(device=...)``): with ``auto``
flowerdro's own loops and the received model's loss use CUDA when available, while
``train_fn`` and ``test_fn`` get the model on the device (and in the dtype) of the inputs
the user's loader yields, so CPU-only user code runs unchanged on a GPU machine; ``cpu``
puts everything on the CPU; ``cuda`` / ``cuda:N`` put everything there (the user's
functions then move their batches to ``args.device``). Whatever the user's functions do
with the model (move it to another device or dtype), the reply holds its weights on the
CPU in the dtypes the server sent.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from flowerdro.clients import handlers
from flowerdro.clients.config import Settings
from flowerdro.clients.mods import ModChain, ReportMods, is_update_mod, mod_name
from flowerdro.clients.routes import ROUTE_SPECS, handler
from flowerdro.clients.training import LocalData, LossFn, resolve_device
from flowerdro.clients.userdata import (
    call_data_fn,
    data_fn_extras,
    hold_out,
    split_parts,
    tensors_of,
)
from flowerdro.clients.userloop import TrainArgs, evaluate_user, train_user_loop
from flowerdro.clients.userruntime import (
    Placement,
    UserRuntime,
    check_model,
    check_state_dict,
    loop_placement,
    state_as_sent,
)
from flowerdro.legacy_wire import FromLegacy
from flowerdro.protocol import check_device

__all__ = ["ROUTES", "USER_LOOP_ROUTES", "ClientKit", "TrainArgs", "add_routes", "check_state_dict",
           "state_as_sent", "tensors_of"]

#: Message types whose local loop is the user's ``train_fn`` (when given).
USER_LOOP_ROUTES: tuple[str, ...] = ("train", "train.sgd")

#: Every message type a flowerdro strategy sends → flowerdro's handler of it
#: (:data:`flowerdro.clients.routes.ROUTE_SPECS`, each module imported on first call).
ROUTES: dict[str, Callable[[Message, Context], Message]] = {t: handler(t) for t in ROUTE_SPECS}

#: How many runs' runtimes a kit keeps (the latest runs it served; an older one's are dropped).
RUNS_KEPT = 2


@dataclass
class ClientKit:
    """The user's pieces, served to every flowerdro strategy.

    Parameters
    ----------
    model_fn : callable
        ``model_fn() -> torch.nn.Module``, a fresh model (e.g. the project's ``Net``).
    data_fn : callable
        ``data_fn(partition_id, num_partitions) -> (train, test)`` or ``(train, validation,
        test)``; each part is a loader of ``(x, y)`` batches or dict batches (see
        ``batch_keys``) or a pair ``(x, y)`` of tensors/arrays. Further parameters are
        filled by name: ``batch_size`` gets run-config ``batch-size`` (else the parameter's
        default, else 32), ``context`` the node's Context, ``run_config`` the run config; so
        a quickstart's ``load_data(partition_id, num_partitions, batch_size)`` is passed as
        it is. Called once per partition and run. The validation part answers evaluate
        messages with ``eval-split = "validation"`` (see the module docstring for
        ``validation-fraction``).
    loss_fn : callable
        The minibatch loss ``loss_fn(model(x), y)`` → scalar mean loss (e.g.
        ``torch.nn.CrossEntropyLoss()``); the algorithm-defined loops minimise it.
    train_fn : callable, optional
        ``train_fn(model, train_loader, args: TrainArgs) -> float | None``: the project's
        own training for the algorithms that allow any local loop (:data:`USER_LOOP_ROUTES`);
        unset, flowerdro's SGD runs there too. ``args.epochs`` is an int when whole.
    test_fn : callable, optional
        ``test_fn(model, test_loader, device) -> (loss, accuracy)`` (accuracy a float or a
        dict of metrics holding it, see ``test_accuracy_key``); unset, flowerdro evaluates
        ``loss_fn`` and the argmax accuracy on the test tensors.
    accuracy_metric, loss_metric : str
        The names of the evaluate reply's metrics when the message names none (the
        server's ``accuracy-metric`` / ``loss-metric``, sent with every evaluate message,
        win; the defaults are the server's).
    test_accuracy_key : str, optional
        The entry of ``test_fn``'s metrics dict that is the accuracy; unset, the server's
        ``accuracy-metric`` when the dict holds it, else ``accuracy``.
    batch_keys : (str, str), optional
        Input and label keys of dict batches (e.g. ``("img", "label")``).
    task : {"classification", "regression"}
        Regression reports the loss only.
    device : str or torch.device, optional
        Where things run, as run-config ``device`` says it (``"auto"``, ``"cpu"``, ``"cuda"``,
        ``"cuda:N"`` or a ``torch.device``); unset, the run config's ``device`` (default
        ``auto``). ``auto``: flowerdro's own loops on CUDA when available, ``train_fn`` and
        ``test_fn`` given the model on the device and in the dtype of the inputs the
        loader yields; any other value: everything on that device. Refused where the
        device is absent, or where it differs from the run config's ``device``.
    """

    model_fn: Callable[[], nn.Module]
    data_fn: Callable[..., tuple[Any, ...]]
    loss_fn: LossFn | None = None
    train_fn: Callable[[nn.Module, Any, TrainArgs], Any] | None = None
    test_fn: Callable[[nn.Module, Any, torch.device], tuple[float, Any]] | None = None
    accuracy_metric: str = "test_acc"
    loss_metric: str = "test_loss"
    test_accuracy_key: str | None = None
    batch_keys: tuple[str, str] | None = None
    task: str = "classification"
    device: str | torch.device | None = None
    #: Runtimes by (run id, partition, partitions, device[, validation fraction, split seed]).
    _runtimes: dict[tuple[Any, ...], UserRuntime] = field(default_factory=dict, repr=False)
    _token: str = field(default_factory=lambda: uuid.uuid4().hex, repr=False, compare=False)
    #: The class the user built (named in errors about its arguments): ``LegacyClientApp`` builds kits too.
    _owner: str = field(default="ClientKit", repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the pieces and an identity token, not the runtimes (see :func:`_restore_kit`)."""
        pieces = {k: v for k, v in self.__dict__.items() if k not in ("_runtimes", "_token")}
        return _restore_kit, (self._token, pieces)

    def __post_init__(self) -> None:
        if not callable(self.model_fn):
            raise TypeError("model_fn: expected a callable returning a torch.nn.Module (e.g. your Net class)")
        if not callable(self.data_fn):
            raise TypeError("data_fn: expected a callable (partition_id, num_partitions) -> (train, test)")
        data_fn_extras(self.data_fn)  # a parameter the kit cannot fill is refused now, naming it
        if self.loss_fn is None or not callable(self.loss_fn):
            raise ValueError("loss_fn: missing; flowerdro's algorithm-defined loops (DRFA, SCAFFOLD, SCAFF-PD, "
                             "FedRobust, DR-DSGD, FGM/PGD) minimise loss_fn(model(x), y): pass e.g. "
                             "torch.nn.CrossEntropyLoss()")
        if self.task not in ("classification", "regression"):
            raise ValueError(f"task: unknown task {self.task!r}; allowed: classification, regression")
        for name in ("accuracy_metric", "loss_metric"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}: expected a non-empty metric name, got {getattr(self, name)!r}")
        if self.batch_keys is not None and (not isinstance(self.batch_keys, tuple | list) or len(self.batch_keys) != 2):
            raise ValueError(f"batch_keys: expected (input key, label key), e.g. ('img', 'label'), got "
                             f"{self.batch_keys!r}")
        if self.device is not None:
            check_device(str(self.device) if isinstance(self.device, torch.device) else self.device)

    # ------------------------------------------------------------------ runtime
    def runtime(self, context: Context) -> UserRuntime:
        """The node's runtime in this run: the user's data as tensors (read once per partition, run and
        device) and model factory."""
        cfg = context.node_config
        if "partition-id" in cfg:
            pid, n = int(cfg["partition-id"]), int(cfg.get("num-partitions", 0))
        else:
            pid, n = int(context.node_id), 0
        setting = self._device_setting(context.run_config.get("device"))
        s = Settings(context.run_config)
        fraction = s.float("validation-fraction", 0.0, minimum=0.0)
        if fraction >= 1:
            raise ValueError(f"validation-fraction: must be < 1, got {fraction}")
        split_seed = s.int("data-seed", s.int("seed", 0))
        key: tuple[Any, ...] = (int(context.run_id), pid, n, setting)
        if fraction > 0:
            key += (fraction, split_seed)
        if key not in self._runtimes:
            runs = list(dict.fromkeys([k[0] for k in self._runtimes] + [key[0]]))
            for old in [k for k in self._runtimes if k[0] in runs[:-RUNS_KEPT]]:
                del self._runtimes[old]  # a run this kit no longer serves
            self._runtimes[key] = self._build(pid, n, context, setting, fraction, split_seed)
        return self._runtimes[key]

    def _device_setting(self, run_config_value: Any) -> str:
        """The ``device`` that applies: the kit's own when given, else the run config's (``auto`` unset).

        A kit built with one device under a run config that names another is refused: the
        user asked for two things and only one can hold.
        """
        asked = "auto" if run_config_value in (None, "") else check_device(run_config_value)
        if self.device is None:
            return asked
        own = check_device(str(self.device) if isinstance(self.device, torch.device) else self.device)
        if asked not in ("auto", own):
            raise ValueError(f"device: the ClientKit was built with device={own!r} but the run config sets "
                             f"device = {asked!r}; set one of them")
        return own

    def _build(self, pid: int, n: int, context: Context, device_setting: str = "auto", fraction: float = 0.0,
               split_seed: int = 0) -> UserRuntime:
        train, validation, test = split_parts(call_data_fn(self.data_fn, pid, n, context))
        if validation is not None and fraction > 0:
            raise ValueError(f"validation-fraction: your data_fn returns its own validation data (train, validation, "
                             f"test); set validation-fraction = 0 (got {fraction}) or return (train, test)")
        if validation is None and fraction > 0 and (self.train_fn is not None or self.test_fn is not None):
            which = "train_fn trains on your train loader" if self.train_fn is not None else \
                "test_fn evaluates your own loaders"
            raise ValueError(f"validation-fraction: your {which}, which cannot see the rows held out of the "
                             "training tensors; return (train, validation, test) from data_fn instead and set "
                             "validation-fraction = 0")
        keys = tuple(self.batch_keys) if self.batch_keys is not None else None
        x_tr, y_tr = tensors_of(train, "train data", keys, self._owner)  # type: ignore[arg-type]
        x_te, y_te = tensors_of(test, "test data", keys, self._owner)  # type: ignore[arg-type]
        x_va = y_va = None
        if validation is not None:
            x_va, y_va = tensors_of(validation, "validation data", keys, self._owner)  # type: ignore[arg-type]
        elif fraction > 0:
            x_tr, y_tr, x_va, y_va = hold_out(x_tr, y_tr, fraction, split_seed, pid, self.task)
        for what, x in (("test data", x_te), ("validation data", x_va)):
            if x is not None and x.shape[1:] != x_tr.shape[1:]:
                raise ValueError(f"{what}: inputs of shape {tuple(x.shape[1:])} per example; the training "
                                 f"inputs have {tuple(x_tr.shape[1:])}")
        if self.task == "classification" and torch.is_floating_point(y_tr):
            raise ValueError(f"train data: labels have dtype {y_tr.dtype}; a classification task expects integer "
                             "class labels (task='regression' for float targets)")
        device = resolve_device(device_setting)
        # the user's functions: on the device and dtype of the inputs their loader yields, unless told otherwise
        user = Placement(x_tr.device if device_setting == "auto" else device, x_tr.dtype)
        loops = loop_placement(device, x_tr.dtype)

        def label(y: torch.Tensor) -> torch.Tensor:
            return y.to(loops.device, torch.int64 if self.task == "classification" else loops.dtype)

        data = LocalData(x_tr.to(loops.device, loops.dtype), label(y_tr), x_te.to(loops.device, loops.dtype),
                         label(y_te), None if x_va is None else x_va.to(loops.device, loops.dtype),
                         None if y_va is None else label(y_va))
        rt = UserRuntime(self, pid, n, data, train, test, num_classes=0, user=user, device_setting=device_setting,
                         validation_loader=validation)
        rt.num_classes = check_model(rt)
        return rt

    # ------------------------------------------------------------------ serving
    def serve(self, message_type: str) -> Callable[[Message, Context], Message]:
        """The function that answers ``message_type`` with the user's pieces."""
        if message_type not in ROUTES:
            raise ValueError(f"message_type: unknown {message_type!r}; allowed: {', '.join(ROUTES)}")
        inner: Callable[[Message, Context], Message]
        if message_type == "evaluate":
            inner = partial(evaluate_user, self)
        elif message_type in USER_LOOP_ROUTES and self.train_fn is not None:
            inner = partial(train_user_loop, self)
        else:
            inner = ROUTES[message_type]
        return _KitHandler(self, inner)

    def client_app(self, mods: Sequence[Any] | None = None) -> ClientApp:
        """A new ClientApp serving every flowerdro message type (:data:`ROUTES`), with Flower ``mods``.

        Mods that act on a training reply's model (Flower's clipping mods, ``LocalDpMod``,
        ``secaggplus_mod``) wrap the training routes only (:mod:`flowerdro.clients.mods`).
        """
        return add_routes(ClientApp(), self, mods=mods)


#: The kits unpickled in this process, by token (see :func:`_restore_kit`).
_RESTORED: dict[str, ClientKit] = {}


def _restore_kit(token: str, pieces: dict[str, Any]) -> ClientKit:
    """The kit ``token`` names: the one already unpickled in this process, else a new one.

    Flower's Ray simulation pickles the ClientApp with every message it hands an actor;
    without this, each message would meet a new kit with no runtimes and call the user's
    ``data_fn`` again.
    """
    kit = _RESTORED.get(token)
    if kit is None:
        kit = ClientKit.__new__(ClientKit)
        kit.__dict__.update(pieces, _runtimes={}, _token=token)
        _RESTORED[token] = kit
    return kit


@dataclass(frozen=True)
class _KitHandler:
    """``inner(message, context)`` with the kit's runtimes as the handlers' runtime provider.

    A module-level class (not a closure), so a pickled ClientApp holds a reference to it.
    """

    kit: ClientKit
    inner: Callable[[Message, Context], Message]

    def __call__(self, message: Message, context: Context) -> Message:
        token = handlers.RUNTIME_PROVIDER.set(self.kit.runtime)
        try:
            return self.inner(message, context)
        finally:
            handlers.RUNTIME_PROVIDER.reset(token)


def add_routes(app: ClientApp, kit: ClientKit, *, replace: bool = False,
               mods: Sequence[Any] | None = None) -> ClientApp:
    """Register ``kit``'s handler of every flowerdro message type on ``app``, with Flower ``mods``.

    Routes the app already serves are kept (its own ``train`` / ``evaluate``) unless
    ``replace`` is True; keep your ``train`` route only if its reply's ``train_loss`` is
    the loss of the *received* model (q-FedAvg and FedMGDA+ read it so) and your
    ``evaluate`` route's metric names match the server's ``accuracy-metric``/``loss-metric``.
    ``mods`` wrap the kit's routes as ``ClientApp(mods=...)`` would, except that mods acting on
    a training reply's model wrap the training routes only (:class:`~flowerdro.clients.mods.ModChain`);
    the ``query.init`` reply names them for the server's checks. Returns ``app``.

    Raises
    ------
    ValueError
        ``app`` itself was built with such a mod (``ClientApp(mods=[LocalDpMod(...)])``):
        Flower would wrap the evaluate and query routes in it too, where it fails.
    """
    own = list(getattr(app, "_mods", []) or [])
    if bad := [mod_name(m) for m in own if is_update_mod(m)]:
        raise ValueError(f"mods: your ClientApp was built with {bad}, which Flower applies to every message type, "
                         "but evaluate and query replies carry no model for them; build the ClientApp without them "
                         "and pass them to add_routes(app, kit, mods=[...]) (or kit.client_app(mods=[...])), which "
                         "applies them to the training routes only")
    chain = ModChain(list(mods or []), extra_names=[mod_name(m) for m in own])
    registered = getattr(app, "_registered_funcs", {})
    for mtype in ROUTES:
        category, _, action = mtype.partition(".")
        full = f"{category}.{action or 'default'}"
        if full in registered:
            if not replace:
                continue
            del registered[full]
        handler_: Any = kit.serve(mtype)
        if mtype == "query.init":
            handler_ = ReportMods(handler_, chain)
        elif mtype in ("train", "evaluate"):  # also a LegacyStrategy's FitIns / EvaluateIns
            handler_ = FromLegacy(handler_, kit.serve)
        getattr(app, category)(action or "default", mods=chain.for_type(mtype))(handler_)
    return app

