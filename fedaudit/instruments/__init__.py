"""What a run carries for its audit, on the training side: the canaries planted in its records
(:mod:`~fedaudit.instruments.canaries`), the log of every DP query's release (:mod:`~fedaudit.instruments.queries`), the
canary log of a Flower app (:mod:`~fedaudit.instruments.canary_log`), and the per-record membership signals computed
where the records are (:mod:`~fedaudit.instruments.record_signals`). The attacks in ``fedaudit.attacks`` read them."""
