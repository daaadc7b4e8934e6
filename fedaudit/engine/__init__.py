"""Engines that run clients: in-process (local) and, later, Flower."""
