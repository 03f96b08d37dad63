"""Every flowerdro strategy on Flower's legacy API: ``ServerAppComponents`` and ``NumPyClient``.

Server side, :class:`LegacyStrategy` is a :class:`flwr.server.strategy.Strategy` that a
legacy project puts where it put ``FedAvg``:

.. code-block:: python

    strategy = LegacyStrategy("drfa", context.run_config, num_rounds=num_rounds,
                              initial_parameters=parameters)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=num_rounds))

It does not approximate the algorithms with ``configure_fit``/``aggregate_fit``: Flower's
legacy ``Server`` hands the strategy a client manager whose proxies talk to the clients
through the run's :class:`flwr.serverapp.Grid`, and the adapter runs the Message-API
strategy's own loop (:meth:`flowerdro.strategies.base.FairStrategy.start`) on that grid.
DRFA's train-then-query at w(t′), SCAFF-PD's loss/gradient then corrected training, the
seeded sampling and every update rule are those of the Message-API strategy, so both APIs
give the same λ sequence and model. The whole run happens in the first round's
``configure_fit``; the legacy Server's later rounds carry no instructions ("no clients
selected" in its log), and ``evaluate(r, ...)`` hands round r's record (fairness numbers,
λ) to the Server's ``History`` as centralized metrics. The final model is
:attr:`LegacyStrategy.final_parameters`.

Client side, :class:`LegacyClientApp` wraps the project's unchanged ``client_fn`` (a
NumPyClient): Flower's legacy messages go to the NumPyClient as before, and flowerdro's
message types go to a :class:`~flowerdro.clients.kit.ClientKit` built from the
NumPyClient's pieces: its model (attribute ``net``), its loaders (``trainloader``,
``valloader``), its ``fit`` as the training function of the algorithms that allow any
local loop and its ``evaluate`` as the test function. Per-client state (SCAFFOLD's c_i,
FedRobust's (Λ_i, δ_i)) is kept by the server per partition and sent with each message,
as on the Message API.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from torch import nn

from flowerdro.clients.kit import ClientKit, TrainArgs
from flowerdro.clients.training import LossFn
from flowerdro.strategies.messaging import missing_route_hint

__all__ = ["LegacyClientApp", "LegacyStrategy"]


class LegacyStrategy(Strategy):
    """A flowerdro strategy where a legacy project puts its ``flwr.server.strategy.Strategy``.

    Parameters
    ----------
    strategy : str or FairStrategy
        A registered name (built with :func:`~flowerdro.strategies.build_strategy` from
        ``run_config``) or a strategy object.
    run_config : Mapping, optional
        The run config (settings of the algorithm, the loop and the clients' local work).
    num_rounds : int
        Rounds to run; the same as the ``ServerConfig``'s.
    initial_parameters : Parameters, optional
        The initial model as the legacy project builds it (``ndarrays_to_parameters(get_weights(Net()))``),
        in ``state_dict`` order. Unset: a client's model (``query.init``).
    timeout : float
        Seconds to wait for the replies of one exchange.
    own_keys : iterable of str
        The project's own run-config keys that look like a flowerdro key (see
        :func:`~flowerdro.strategies.build_strategy`, which refuses such keys otherwise).
    """

    def __init__(self, strategy: Any, run_config: Mapping[str, Any] | None = None, *, num_rounds: int,
                 initial_parameters: Parameters | None = None, timeout: float = 3600.0,
                 own_keys: Iterable[str] = ()) -> None:
        from flowerdro.strategies import build_strategy

        self.run_config = dict(run_config or {})
        self.strategy = (build_strategy(strategy, self.run_config, own_keys=own_keys) if isinstance(strategy, str)
                         else strategy)
        if num_rounds < 1:
            raise ValueError(f"num_rounds: must be >= 1, got {num_rounds}")
        self.num_rounds, self.timeout = int(num_rounds), float(timeout)
        self.initial_parameters = initial_parameters
        self.result: Any = None
        self._arrays: ArrayRecord | None = None

    def __repr__(self) -> str:
        return f"LegacyStrategy({self.strategy.name})"

    # ------------------------------------------------------------------ the grid behind the proxies
    def _grid(self, client_manager: ClientManager) -> Any:
        # Flower's legacy loop registers the grid's nodes when num_available/all/sample is
        # called, and otherwise every 5 s: ask first, so that wait_for does not sit out the 5 s
        client_manager.num_available()
        client_manager.wait_for(1, timeout=int(self.timeout))
        for proxy in client_manager.all().values():
            grid = getattr(proxy, "grid", None)
            if grid is not None:
                return grid
        raise RuntimeError("LegacyStrategy: the client proxies carry no Grid; run it in a Flower ServerApp "
                           "(ServerApp(server_fn=...) with ServerAppComponents), which talks to the clients "
                           "through a Grid")

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The initial model: the names and shapes of a client's model, the values of ``initial_parameters``."""
        from flowerdro.runs import initial_arrays

        try:
            named = initial_arrays(self._grid(client_manager), self.run_config, self.timeout)
        except RuntimeError as exc:
            hint = missing_route_hint(str(exc))
            raise RuntimeError(f"{exc}" + (f"\n=> {hint}" if hint else "")) from exc
        if self.initial_parameters is not None:
            values = parameters_to_ndarrays(self.initial_parameters)
            keys = list(named.keys())
            if len(values) != len(keys) or any(tuple(v.shape) != tuple(named[k].shape) for k, v in zip(keys, values, strict=True)):
                raise ValueError(
                    "initial_parameters: expected the client model's arrays in state_dict order "
                    f"{[(k, tuple(named[k].shape)) for k in keys]}, got shapes {[tuple(v.shape) for v in values]}")
            named = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})
        self._arrays = named
        return ndarrays_to_parameters([named[k].numpy() for k in named.keys()])

    # ------------------------------------------------------------------ the rounds
    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                      ) -> list[tuple[ClientProxy, FitIns]]:
        """Round 1 runs the Message-API strategy's whole loop on the grid; no legacy fit instructions."""
        if self.result is None:
            grid = self._grid(client_manager)
            arrays = self._arrays
            if arrays is None:
                values = parameters_to_ndarrays(parameters)
                arrays = ArrayRecord({str(i): Array(np.asarray(v)) for i, v in enumerate(values)})
            self.result = self.strategy.start(grid, arrays, num_rounds=self.num_rounds, timeout=self.timeout)
        return []

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Never given results (the rounds run in :meth:`configure_fit`): the final model."""
        return self.final_parameters, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """No legacy evaluation: the strategy evaluates every client itself each round."""
        return []

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[Any]) -> tuple[float | None, dict[str, Scalar]]:
        """Never given results."""
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """Round ``server_round``'s record as (mean client loss, scalar fields such as ``acc_worst``)."""
        history = self.strategy.history
        if server_round < 1 or server_round > len(history):
            return None
        rec = history[server_round - 1]
        metrics: dict[str, Scalar] = {k: v for k, v in rec.items()
                                      if isinstance(v, int | float) and not isinstance(v, bool)}
        loss = float(rec.get("loss_mean", math.nan))
        return loss, metrics

    @property
    def final_parameters(self) -> Parameters | None:
        """The model the run returned (None before the run)."""
        if self.result is None or self.result.arrays is None:
            return None
        arrays = self.result.arrays
        return ndarrays_to_parameters([arrays[k].numpy() for k in arrays.keys()])


# --------------------------------------------------------------------------- client side
def _is_flowerdro(message: Message) -> bool:
    """flowerdro's message types carry an action (``train.drfa``) or Message-API ``arrays``."""
    return "." in message.metadata.message_type or "arrays" in message.content.array_records


def _numpy_client(client: Any) -> Any:
    return getattr(client, "numpy_client", client)


def _load_positional(model: nn.Module, values: list[np.ndarray]) -> None:
    keys = list(model.state_dict().keys())
    if len(values) != len(keys):
        raise ValueError(f"fit: your NumPyClient returned {len(values)} arrays; the model has {len(keys)} "
                         "(state_dict order expected)")
    model.load_state_dict({k: torch.as_tensor(np.array(v)) for k, v in zip(keys, values, strict=True)}, strict=True)


#: The LegacyClientApps unpickled in this process, by token (see :func:`_restore_app`).
_RESTORED: dict[str, LegacyClientApp] = {}


def _restore_app(token: str, state: dict[str, Any]) -> LegacyClientApp:
    """The app ``token`` names: the one already unpickled in this process, else a new one.

    Flower's Ray simulation pickles the ClientApp with every message it hands an actor;
    without this, each message would build the node's kit again (``client_fn`` and a pass
    over its loaders).
    """
    app = _RESTORED.get(token)
    if app is None:
        app = LegacyClientApp.__new__(LegacyClientApp)
        app.__dict__.update(state, _kits={})
        _RESTORED[token] = app
    return app


class LegacyClientApp(ClientApp):
    """A legacy ``ClientApp(client_fn=...)`` that also serves every flowerdro message type.

    Parameters
    ----------
    client_fn : callable
        The project's ``client_fn(context)`` returning its NumPyClient (``.to_client()`` or not).
    loss_fn : callable
        The minibatch loss ``loss_fn(model(x), y)`` of the algorithm-defined loops.
    model_attr, train_attr, test_attr : str
        The NumPyClient's attributes holding its model and its train/test loaders.
    use_fit : bool
        Run the NumPyClient's ``fit`` for the algorithms that allow any local loop (its
        config gets ``lr``, ``local-epochs``, ``local-steps``, ``batch-size``,
        ``server-round``); False: flowerdro's SGD there too.
    **kit_options
        Further :class:`~flowerdro.clients.kit.ClientKit` options (``batch_keys``,
        ``accuracy_metric``, ``test_accuracy_key``, ...).
    """

    def __init__(self, client_fn: Callable[[Context], Any], *, loss_fn: LossFn, model_attr: str = "net",
                 train_attr: str = "trainloader", test_attr: str = "valloader", use_fit: bool = True,
                 **kit_options: Any) -> None:
        super().__init__(client_fn=client_fn)
        self._client_fn, self._loss_fn = client_fn, loss_fn
        self._attrs = (model_attr, train_attr, test_attr)
        self._use_fit, self._kit_options = use_fit, kit_options
        self._kits: dict[int, ClientKit] = {}
        self._kit_options.setdefault("test_accuracy_key", "accuracy")
        self._token = uuid.uuid4().hex

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the app without its nodes' kits (see :func:`_restore_app`)."""
        return _restore_app, (self._token, {k: v for k, v in self.__dict__.items() if k != "_kits"})

    def __call__(self, message: Message, context: Context) -> Message:
        """flowerdro's message types to the kit, Flower's legacy ones to the NumPyClient."""
        if _is_flowerdro(message):
            return self.kit(context).serve(message.metadata.message_type)(message, context)
        return super().__call__(message, context)

    def kit(self, context: Context) -> ClientKit:
        """The node's kit, built once from its NumPyClient."""
        nid = int(context.node_id)
        if nid not in self._kits:
            self._kits[nid] = self._build(context)
        return self._kits[nid]

    def _build(self, context: Context) -> ClientKit:
        client = _numpy_client(self._client_fn(context))
        model_attr, train_attr, test_attr = self._attrs
        for attr in self._attrs:
            if not hasattr(client, attr):
                raise ValueError(f"LegacyClientApp: your client has no attribute {attr!r} (model_attr/train_attr/"
                                 f"test_attr name its model and loaders; it has {sorted(vars(client))})")
        net: nn.Module = getattr(client, model_attr)

        def train_fn(model: nn.Module, loader: Any, a: TrainArgs) -> float | None:
            params = [v.detach().cpu().numpy() for v in model.state_dict().values()]
            config = {"lr": a.lr, "local-epochs": a.epochs, "local-steps": a.steps, "batch-size": a.batch_size,
                      "server-round": a.server_round}
            new, _, metrics = client.fit(params, config)
            _load_positional(model, new)
            loss = metrics.get("train_loss") if isinstance(metrics, Mapping) else None
            return float(loss) if isinstance(loss, int | float) else None

        def test_fn(model: nn.Module, loader: Any, device: torch.device) -> tuple[float, dict[str, Any]]:
            params = [v.detach().cpu().numpy() for v in model.state_dict().values()]
            loss, _, metrics = client.evaluate(params, {})
            return float(loss), dict(metrics)

        options = dict(self._kit_options)
        if hasattr(client, "evaluate"):
            options.setdefault("test_fn", test_fn)
        return ClientKit(model_fn=lambda: net, data_fn=lambda pid, n: (getattr(client, train_attr),
                                                                         getattr(client, test_attr)),
                         loss_fn=self._loss_fn, train_fn=train_fn if self._use_fit else None, **options)

