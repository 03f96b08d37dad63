"""msgexample: a Flower / PyTorch app (Message API) whose strategy is any flowerdro strategy."""
