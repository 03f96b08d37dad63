"""legacyexample: a Flower / PyTorch app."""

import torch
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from flowerdro.legacy import LegacyStrategy
from legacyexample.task import Net, get_weights


def server_fn(context: Context):
    # Read from config
    num_rounds = context.run_config["num-server-rounds"]

    # Initialize model parameters
    torch.manual_seed(0)
    ndarrays = get_weights(Net())
    parameters = ndarrays_to_parameters(ndarrays)

    # Define strategy
    strategy = LegacyStrategy(context.run_config["strategy"], context.run_config, num_rounds=num_rounds,
                              initial_parameters=parameters)
    config = ServerConfig(num_rounds=num_rounds)

    return ServerAppComponents(strategy=strategy, config=config)


# Create ServerApp
app = ServerApp(server_fn=server_fn)
