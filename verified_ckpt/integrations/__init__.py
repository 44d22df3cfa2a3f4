"""Thin adapters over the public API for the frameworks users already train with; each imported on demand.

``dcp`` (``torch.distributed.checkpoint``'s storage writer and reader), ``transformers`` (Hugging Face's ``Trainer``),
``lightning`` (PyTorch Lightning), and ``stepping``, the guarded optimizer step the last two share.
"""
