"""Training: the recipe, the step loop and its hooks, checkpoints, resumption, distribution."""
