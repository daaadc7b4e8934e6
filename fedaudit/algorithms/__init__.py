"""Federated algorithms, one family per module."""
