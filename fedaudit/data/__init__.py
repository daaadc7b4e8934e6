"""Datasets, readers, partitioners and the membership split."""
