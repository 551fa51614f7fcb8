"""Adapters for training frameworks: ``flatcomm.integrations.lightning`` (PyTorch Lightning),
``flatcomm.integrations.accelerate`` (Hugging Face Accelerate), ``flatcomm.integrations.transformers``
(the Hugging Face ``Trainer``). Each imports its framework when it is imported itself; this package
imports none of them (``pip install flatcomm[integrations]`` brings all three). They save every rank's
flatcomm state with the framework's rank-0 checkpoints through :mod:`flatcomm.rank_states`.
See docs/integrations.md.
"""
