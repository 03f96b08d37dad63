"""msgexample: a Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flowerdro.strategies import build_strategy

from msgexample.task import Net

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    num_rounds: int = context.run_config["num-server-rounds"]

    # Load global model
    torch.manual_seed(0)
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Any flowerdro strategy, chosen by the run config's "strategy" key
    strategy = build_strategy(context.run_config["strategy"], context.run_config)

    # Start strategy, run for `num_rounds`
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)

    # Per-round fairness numbers (mean and worst client accuracy) and the final model
    print("worst-client accuracy per round:", [r.get("acc_worst") for r in strategy.history])
    global_model.load_state_dict(result.arrays.to_torch_state_dict())
