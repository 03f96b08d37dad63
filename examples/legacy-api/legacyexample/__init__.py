"""legacyexample: a Flower / PyTorch app (legacy API) whose strategy is any flowerdro strategy."""
