"""The parts of fedaudit's SecAgg+ rounds that need no federation: the masks from whole keys, and what a site's
reply carries (the federation itself: test_deployment.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flwr.client.mod", reason="the flower extra is not installed")  # `make test` installs it


def test_masks_come_from_the_whole_key_where_flowers_fold_it_to_32_bits() -> None:
    """Two keys that differ but fold to the same 32 bits get the same masks from Flower 1.42's generator (a server
    could search the 2^32 seeds) and different ones from fedaudit's; shapes, dtype and range are Flower's."""
    import importlib

    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    from fedaudit.engine.secure_sum import _full_key_masks, mask_of

    key = bytes(range(32))
    other = bytes(b ^ 0x5A for b in key[:8]) + key[8:]  # the two words XOR-ed alike: the same fold
    shapes = [(3, 4), (), (5,)]
    assert all(
        np.array_equal(a, b)
        for a, b in zip(pseudo_rand_gen(key, 1 << 32, shapes), pseudo_rand_gen(other, 1 << 32, shapes))
    )
    ours, theirs = mask_of(key, 1 << 32, shapes), mask_of(other, 1 << 32, shapes)
    assert not np.array_equal(ours[0], theirs[0])
    assert [a.shape for a in ours] == shapes and all(a.dtype == np.int64 for a in ours)
    assert all(0 <= int(a.min()) and int(a.max()) < (1 << 32) - 1 for a in ours)
    assert all(np.array_equal(a, b) for a, b in zip(ours, mask_of(key, 1 << 32, shapes)))  # a key, one mask
    module = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
    with _full_key_masks(module):
        assert module.pseudo_rand_gen is mask_of
    assert module.pseudo_rand_gen is pseudo_rand_gen


def test_a_sites_reply_in_a_secure_sum_carries_its_payload_in_float64_and_no_training_loss(monkeypatch) -> None:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedaudit.engine.secure_sum import SUMMED, as_fit_result

    for name in ("_task_id", "_run_id", "_node_id"):  # what a ClientApp process has set
        monkeypatch.setattr(TaskIdentity, name, 1)
    asked = Message(RecordDict({"task": ConfigRecord({"client": 0})}), message_type="train", dst_node_id=1)
    payload = ArrayRecord({"w": Array(np.array([0.1, -0.2], dtype=np.float32)), "b": Array(np.zeros(1, np.float32))})
    metrics = json.dumps({"train_loss": 1.5, "local_steps": 4.0})
    info = ConfigRecord({"client": 0, "num_examples": 9, "metrics": metrics, "events": "[]", "fingerprint": "f"})
    reply = Message(RecordDict({"payload": payload, "info": info}), reply_to=asked)
    masked = as_fit_result(reply, asked)
    arrays = [a.numpy() for a in masked.content["fitres.parameters"].values()]
    assert [a.dtype for a in arrays] == [np.float64, np.float64]
    assert np.array_equal(arrays[0], np.array([0.1, -0.2], dtype=np.float32).astype(np.float64))
    assert json.loads(str(masked.content["info"]["metrics"])) == {"local_steps": 4.0}
    assert json.loads(str(masked.content["info"][SUMMED])) == ["w", "b"]
    assert set(masked.content.array_records) == {"fitres.parameters"}
    with pytest.raises(RuntimeError, match="beside the payload"):
        state = ArrayRecord({"c": Array(np.zeros(1, np.float32))})
        as_fit_result(Message(RecordDict({"payload": payload, "info": info, "state": state}), reply_to=asked), asked)
