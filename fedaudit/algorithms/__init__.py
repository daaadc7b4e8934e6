"""Federated algorithms, one family per module, each with its configuration section in a torch-free
``<name>_settings`` module beside it; :mod:`fedaudit.registry` names them and builds them
(:func:`fedaudit.algorithms.base.get_algorithm`)."""
