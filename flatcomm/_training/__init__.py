"""Pieces every training integration shares (:mod:`flatcomm.ddp`, :mod:`flatcomm.fsdp`,
:mod:`flatcomm.optim`): the options they take (``options``), the residual store keyed by parameter
(``residual_store``), ``codec="auto"``'s per-parameter exceptions and backoff (``adapt``), and the
checks of everything a checkpoint brings (``checks``). Private: users reach these through the
integrations."""

__all__: list = []  # nothing public: the parallel layer (ddp, fsdp, optim, ...) imports its modules
