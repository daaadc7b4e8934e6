"""The DP primitive (per-sample gradients, clipping, noise, Poisson sampling) and accounting."""
