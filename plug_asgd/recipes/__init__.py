"""Ready-made models and data for trying the strategy on real workloads."""
