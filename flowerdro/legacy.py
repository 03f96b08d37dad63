"""Every flowerdro strategy on Flower's legacy API: ``ServerAppComponents`` and ``NumPyClient``.

Server side, :class:`LegacyStrategy` is a :class:`flwr.server.strategy.Strategy` that a
legacy project puts where it put ``FedAvg``:

.. code-block:: python

    strategy = LegacyStrategy("drfa", context.run_config, num_rounds=num_rounds,
                              initial_parameters=parameters)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=num_rounds))

Each round of Flower's legacy ``Server`` is one round of the Message-API strategy, carried
by the legacy methods: ``configure_fit`` is the strategy's ``configure_train`` (the
algorithm's exchanges that come before training, such as SCAFF-PD's loss/gradient query,
go through the run's :class:`flwr.serverapp.Grid`, which the legacy client proxies
carry), its training messages become ``FitIns``; ``aggregate_fit`` hands the ``FitRes``
back as replies to ``aggregate_train`` (DRFA's loss query at w(t′) again through the
grid); ``configure_evaluate``/``aggregate_evaluate`` are the per-client evaluation, so the
Server's ``History`` gets the distributed losses and metrics of every round, under the
clients' own metric names beside flowerdro's fairness numbers. Flower's legacy wrappers
and workflows therefore see every round: a DP wrapper clips and noises the ``FitRes`` of
the strategies that compose with it (:mod:`flowerdro.privacy`; the others are refused
before the first message), and ``SecAggPlusWorkflow`` sums the training replies of
FedAvg, FedProx, FGM/PGD training and SCAFFOLD with its control variates on the clients.
The sampling and every update rule are the Message-API strategy's, so both APIs give the
same model and λ sequence.

A flowerdro ``FitIns`` carries the message type in its config (``flowerdro.type``) with
the model's array keys and the extra records the algorithm sends (SCAFFOLD's c, FedRobust's
shift) as bytes; the ``FitRes`` parameters are the reply's model followed by its extra
records (DRFA's snapshot, SCAFFOLD's Δc_i), listed in its metrics (``flowerdro.records``).

Client side, :class:`LegacyClientApp` wraps the project's unchanged ``client_fn`` (a
NumPyClient): Flower's own legacy messages go to the NumPyClient as before, and flowerdro's
(the ``FitIns``/``EvaluateIns`` above, and its Message-API queries) go to a
:class:`~flowerdro.clients.kit.ClientKit` built from the NumPyClient's pieces: its model
(attribute ``net``), its loaders (``trainloader``, ``valloader``), its ``fit`` as the
training function of the algorithms that allow any local loop and its ``evaluate`` as the
test function. ``mods=`` takes Flower's mods as ``ClientApp`` does: the ones that act on
a training reply's model (clipping, ``LocalDpMod``, ``secaggplus_mod``) wrap the training
messages only.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
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

from flowerdro.clients.kit import RUNS_KEPT, ClientKit, TrainArgs
from flowerdro.clients.mods import ModChain
from flowerdro.clients.training import LossFn
from flowerdro.legacy_wire import fitres_to_content, flowerdro_ins, message_to_ins, serve_ins
from flowerdro.strategies import build_strategy, initial_arrays
from flowerdro.strategies.replies import missing_route_hint

__all__ = ["LegacyClientApp", "LegacyStrategy"]

# --------------------------------------------------------------------------- server side
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
        Seconds to wait for the replies of one of the algorithm's own exchanges.
    own_keys : iterable of str
        The project's own run-config keys that look like a flowerdro key (see
        :func:`~flowerdro.strategies.build_strategy`, which refuses such keys otherwise).
    """

    def __init__(self, strategy: Any, run_config: Mapping[str, Any] | None = None, *, num_rounds: int,
                 initial_parameters: Parameters | None = None, timeout: float = 3600.0,
                 own_keys: Iterable[str] = ()) -> None:
        self.run_config = dict(run_config or {})
        self.strategy = (build_strategy(strategy, self.run_config, own_keys=own_keys) if isinstance(strategy, str)
                         else strategy)
        if num_rounds < 1:
            raise ValueError(f"num_rounds: must be >= 1, got {num_rounds}")
        self.num_rounds, self.timeout = int(num_rounds), float(timeout)
        self.strategy.num_rounds = self.num_rounds
        self.strategy.comm.transport.timeout = self.timeout
        self.strategy.guard.adapters.append(self)  # it calls the strategy on the drivers' behalf: not a driver
        self.initial_parameters = initial_parameters
        self._keys: list[str] | None = None
        self._sent: dict[int, Message] = {}

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

    def _arrays(self, parameters: Parameters) -> ArrayRecord:
        values = parameters_to_ndarrays(parameters)
        keys = self._keys or [str(i) for i in range(len(values))]
        if len(keys) != len(values):
            raise ValueError(f"parameters: {len(values)} arrays for the model's {len(keys)} ({keys[:5]}, ...)")
        return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})

    def _parameters(self, arrays: ArrayRecord | None) -> Parameters | None:
        return None if arrays is None else ndarrays_to_parameters([arrays[k].numpy() for k in arrays.keys()])

    def _instructions(self, messages: list[Message], client_manager: ClientManager, make: Callable[..., Any],
                      grid: Any = None) -> list[tuple[ClientProxy, Any]]:
        """The messages as (proxy, FitIns/EvaluateIns); an in-process grid is told their order.

        The legacy Server sends them from a thread pool; a grid whose clients share this
        process (:meth:`flowerdro.experiments.InProcessGrid.run_in_order`) then runs them in
        the order the strategy made them, whatever the threads' timing.
        """
        proxies = {int(p.node_id): p for p in client_manager.all().values()}
        if callable(order := getattr(grid, "run_in_order", None)):
            order([int(m.metadata.dst_node_id) for m in messages])
        self._sent = {int(m.metadata.dst_node_id): m for m in messages}
        out = []
        for m in messages:
            proxy = proxies.get(int(m.metadata.dst_node_id))
            if proxy is None:
                raise RuntimeError(f"LegacyStrategy: node {m.metadata.dst_node_id} has no client proxy")
            parameters, config = message_to_ins(m)
            out.append((proxy, make(parameters, config)))
        return out

    def _replies(self, results: Sequence[tuple[ClientProxy, Any]], failures: Sequence[Any],
                 to_content: Callable[[Any], RecordDict]) -> list[Message]:
        """The legacy results as replies to the messages sent (failures as error replies)."""
        replies, answered = [], set()
        for proxy, res in results:
            nid = int(proxy.node_id)
            sent = self._sent.get(nid)
            if sent is None:
                continue
            answered.add(nid)
            try:
                replies.append(Message(content=to_content(res), reply_to=sent))
            except (KeyError, ValueError) as exc:
                replies.append(Message(Error(code=0, reason=f"unreadable reply: {exc}"), reply_to=sent))
        reasons = []
        for f in failures:
            if isinstance(f, tuple) and len(f) == 2 and int(f[0].node_id) in self._sent:
                nid, res = int(f[0].node_id), f[1]
                answered.add(nid)
                reason = getattr(getattr(res, "status", None), "message", str(res))
                replies.append(Message(Error(code=0, reason=str(reason)), reply_to=self._sent[nid]))
            elif str(f) not in reasons:
                reasons.append(str(f))
        if reasons:
            for nid in (n for n in self._sent if n not in answered):
                replies.append(Message(Error(code=0, reason="the legacy Server reported: " + "; ".join(reasons)),
                                       reply_to=self._sent[nid]))
        return replies

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The initial model: the names and shapes of a client's model, the values of ``initial_parameters``.

        The wrappers and workflows that drive this strategy are checked first
        (:mod:`flowerdro.wrappers`): one the algorithm cannot compose with is refused before
        any message.
        """
        self.strategy.guard.observe()
        try:
            named = initial_arrays(self._grid(client_manager), self.run_config, self.timeout)
        except RuntimeError as exc:
            hint = missing_route_hint(str(exc))
            raise RuntimeError(f"{exc}" + (f"\n=> {hint}" if hint else "")) from exc
        if self.initial_parameters is not None:
            values = parameters_to_ndarrays(self.initial_parameters)
            keys = list(named.keys())
            if len(values) != len(keys) or any(tuple(v.shape) != tuple(named[k].shape)
                                               for k, v in zip(keys, values, strict=True)):
                raise ValueError(
                    "initial_parameters: expected the client model's arrays in state_dict order "
                    f"{[(k, tuple(named[k].shape)) for k in keys]}, got shapes {[tuple(v.shape) for v in values]}")
            named = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})
        self._keys = list(named.keys())
        return self._parameters(named)

    # ------------------------------------------------------------------ the rounds
    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                      ) -> list[tuple[ClientProxy, FitIns]]:
        """The strategy's ``configure_train`` as FitIns (its exchanges before training run on the grid)."""
        self.strategy.guard.observe()
        if server_round > self.num_rounds:
            raise ValueError(f"num_rounds: LegacyStrategy(num_rounds={self.num_rounds}) but the Server runs round "
                             f"{server_round}; give both the same number of rounds")
        grid = self._grid(client_manager)
        messages = list(self.strategy.configure_train(server_round, self._arrays(parameters), ConfigRecord(), grid))
        uniform = self._uniform()
        instructions = self._instructions(messages, client_manager, FitIns, grid)
        if uniform:
            for _, ins in instructions:
                ins.config["flowerdro.weight"] = "uniform"
        return instructions

    def _uniform(self) -> bool:
        """Whether the training replies' weights must be equal (SecAgg+ over a strategy that averages uniformly)."""
        return self.strategy.guard.secagg() and self.strategy.name == "scaffold"

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The FitRes as replies to the strategy's ``aggregate_train``: the new model and the training metrics."""
        self.strategy.guard.observe()
        replies = self._replies(results, failures, fitres_to_content)
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        return self._parameters(arrays), _scalars(metrics)

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """The strategy's per-client evaluation as EvaluateIns (none when not due this round)."""
        self.strategy.guard.observe()
        grid = self._grid(client_manager)
        messages = list(self.strategy.configure_evaluate(server_round, self._arrays(parameters), ConfigRecord(),
                                                         grid))
        return self._instructions(messages, client_manager, EvaluateIns, grid)

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[Any]) -> tuple[float | None, dict[str, Scalar]]:
        """The fairness numbers and the clients' own metrics (example-weighted), with the mean client loss."""
        self.strategy.guard.observe()

        def content(res: EvaluateRes) -> RecordDict:
            return RecordDict({"metrics": MetricRecord({k: v for k, v in res.metrics.items()
                                                        if isinstance(v, int | float) and not isinstance(v, bool)})})

        metrics = self.strategy.aggregate_evaluate(server_round, self._replies(results, failures, content))
        scalars = _scalars(metrics)
        loss = scalars.get(self.strategy.loop.loss_metric, scalars.get("loss_mean"))
        return (float(loss) if isinstance(loss, int | float) else None), scalars

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """No centralized evaluation (the clients evaluate, see :meth:`aggregate_evaluate`)."""
        return None

    @property
    def final_parameters(self) -> Parameters | None:
        """The model the run returned (the strategy's output model; None before the first round)."""
        return self._parameters(self.strategy.finish())

    @property
    def history(self) -> list[dict[str, Any]]:
        """The strategy's round records (fairness numbers, λ, failures) so far."""
        return self.strategy.history


def _scalars(metrics: Mapping[str, Any] | None) -> dict[str, Scalar]:
    return {} if metrics is None else {k: v for k, v in metrics.items()
                                       if isinstance(v, int | float) and not isinstance(v, bool)}


# --------------------------------------------------------------------------- client side
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
        config gets ``lr``, ``local-epochs`` (an int when whole), ``local-steps``,
        ``batch-size``, ``server-round``, ``device``: where the kit hands it the model, see
        :class:`~flowerdro.clients.kit.ClientKit`); False: flowerdro's SGD there too.
        ``fit`` and ``evaluate`` may move the client's ``net`` wherever they like.
    mods : list, optional
        Flower mods, as ``ClientApp(mods=...)`` takes them; the ones that act on a
        training reply's model (``fixedclipping_mod``, ``adaptiveclipping_mod``,
        ``LocalDpMod``, ``secaggplus_mod``) wrap the training messages only.
    batch_keys : (str, str), optional
        Input and label keys when the client's loaders yield dict batches (e.g.
        ``("img", "label")``, Flower's quickstarts).
    test_accuracy_key : str, optional
        The entry of ``evaluate``'s metrics dict that is the accuracy; unset, the server's
        ``accuracy-metric`` (sent with every evaluate message) when the dict holds it, else
        ``accuracy``. The accuracy is reported under the server's ``accuracy-metric``.
    **kit_options
        Further :class:`~flowerdro.clients.kit.ClientKit` options (``task``, ``device``, ...).

    The NumPyClient a node's ``client_fn`` builds is kept for the flowerdro messages of one
    run (Flower's own legacy messages call ``client_fn`` each time, as Flower does): its
    loaders are read once per run, and a new run (another ``context.run_id``) builds it
    anew, so no state of a client object carries from one run to the next.
    """

    def __init__(self, client_fn: Callable[[Context], Any], *, loss_fn: LossFn, model_attr: str = "net",
                 train_attr: str = "trainloader", test_attr: str = "valloader", use_fit: bool = True,
                 mods: Sequence[Any] | None = None, **kit_options: Any) -> None:
        super().__init__(client_fn=client_fn)
        self._client_fn, self._loss_fn = client_fn, loss_fn
        self._attrs = (model_attr, train_attr, test_attr)
        self._use_fit, self._kit_options = use_fit, kit_options
        self._kits: dict[tuple[int, int], ClientKit] = {}
        self._mods = ModChain(list(mods or []))
        self._token = uuid.uuid4().hex

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the app without its nodes' kits (see :func:`_restore_app`)."""
        return _restore_app, (self._token, {k: v for k, v in self.__dict__.items() if k != "_kits"})

    def __call__(self, message: Message, context: Context) -> Message:
        """Through the mods: flowerdro's messages to the kit, Flower's legacy ones to the NumPyClient."""
        return self._mods.call(message, context, self._dispatch)

    def _dispatch(self, message: Message, context: Context) -> Message:
        mtype = message.metadata.message_type
        if "." in mtype or "arrays" in message.content.array_records:  # flowerdro's Message-API messages
            reply = self.kit(context).serve(mtype)(message, context)
            return self._mods.report(message, reply)
        if flowerdro_ins(message) is None:
            return self._call(message, context)  # type: ignore[misc]  # Flower's legacy path (client_fn)
        return serve_ins(message, context, self.kit(context).serve)

    def kit(self, context: Context) -> ClientKit:
        """The node's kit in this run, built once per run from the NumPyClient its ``client_fn`` returns."""
        key = (int(context.run_id), int(context.node_id))
        if key not in self._kits:
            runs = list(dict.fromkeys([k[0] for k in self._kits] + [key[0]]))
            for old in [k for k in self._kits if k[0] in runs[:-RUNS_KEPT]]:
                del self._kits[old]  # a run this app no longer serves: its client objects go
            self._kits[key] = self._build(context)
        return self._kits[key]

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
                      "server-round": a.server_round, "device": str(a.device)}
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
                         loss_fn=self._loss_fn, train_fn=train_fn if self._use_fit else None,
                         _owner="LegacyClientApp", **options)
