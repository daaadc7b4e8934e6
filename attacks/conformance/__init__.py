"""Conformance: does a run's mechanism do what its ledger charges for? The checks of ``fedaudit verify``.

- ``checks``: every DP query of a canary run's log against the mechanism (clipping, noise scale, sampling, ledger).
- ``secrecy``: whether the noise came from the clients' secrets, which the server never holds.
- ``probe``: ``verify --probe``, the DP query run on neighbouring batches to measure its sensitivity.
- ``verify``: ``fedaudit verify`` itself: files, signature and the checks above, written to verification.json.
"""
