"""Reconstruction audits: can the server rebuild a client's records from what the client sent?

- ``attack``: ``fedaudit attack --method reconstruction``, the records rebuilt by gradient inversion from each kept
  update or synthetic set, against nulls of the same norm.
- ``image_quality``: PSNR and SSIM of a rebuilt record against the real ones, with intervals.
"""
