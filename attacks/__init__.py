"""Membership inference attacks on trained runs (signals, attacks, metrics)."""
