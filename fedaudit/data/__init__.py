"""Datasets, readers, partitioners and the membership split."""

from fedaudit.data.partition import Partition, PartitionError, partition_dataset, validate_partition_spec
from fedaudit.data.registry import (
    DATASET_NAMES,
    DEFAULT_DATASET,
    DataError,
    Dataset,
    dataset_table,
    dataset_text,
    load_dataset,
    locate_dataset,
)

__all__ = [
    "DATASET_NAMES",
    "DEFAULT_DATASET",
    "DataError",
    "Dataset",
    "Partition",
    "PartitionError",
    "dataset_table",
    "dataset_text",
    "load_dataset",
    "locate_dataset",
    "partition_dataset",
    "validate_partition_spec",
]
