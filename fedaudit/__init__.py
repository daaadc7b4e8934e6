"""fedaudit: train federated models (FedLAP-DP and DP gradient-sharing baselines) and audit their privacy."""

__version__ = "0.1.0"
