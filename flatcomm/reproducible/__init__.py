"""Reproducible data-parallel training: the same weights, bit for bit, on 1, 2 or 4 ranks.

A fixed global batch per step is split into a fixed number ``M`` of micro-batches. Rank r of W
processes micro-batches r, r + W, r + 2W, ... (``M`` must be a multiple of W). Each micro-batch
gradient is turned into int64 fixed point (:func:`flatcomm.to_exact`) on per-block exponents that
are fixed for the step, the integers are added locally and then across ranks (integer addition is
associative, so neither the grouping into ranks nor the order matters), and the sum is converted
back to fp32 once (:func:`flatcomm.from_exact`), divided by ``M`` once and cast to the parameter
dtype once. The gradient the optimizer sees is therefore a function of the global batch only::

    from flatcomm import reproducible

    reproducible.configure()                       # deterministic kernels, 1 intra-op thread
    model = Net()                                  # same init on every rank; NOT wrapped in DDP
    acc = reproducible.ExactGradAccumulator(model, micro_batches=8)
    for batch in batches:                          # the global batch, the same on every rank
        for i in acc.micro_batches():              # this rank's share; backward() in the body
            x, y = batch.micro(i)
            loss_fn(model(x), y).backward()
        if acc.stats.applied:                      # False when a gradient was inf/NaN
            opt.step()                             # p.grad: exact mean over the 8 micro-batches
        print(acc.stats.step, acc.stats.digest)    # sha256 of the reduced gradient bits

**How the exponents are chosen (and why that is rank-count independent).** The exact sum needs one
exponent E per block (|v| < 2^E for every contribution) *before* the first contribution is
converted, and the choice must not depend on which rank saw which micro-batch. Each step uses
exponents predicted from the previous step: ``E = min(128, max(G_b, G_p - span) + margin)`` where
``G_b`` is the previous step's largest exponent of block b over *all* micro-batches (a MAX
all-reduce), ``G_p`` the largest over the block's parameter tensor, ``margin`` (default 4) the
growth in binades tolerated before a replay and ``span`` (default 0: one exponent per tensor)
how far below its tensor's maximum a block's exponent may drop. While accumulating, every
micro-batch's block exponents are compared with E (a cheap integer comparison, so
:func:`flatcomm.to_exact` never sees a value beyond its bound) and their running MAX is kept. After
the last local micro-batch one MAX all-reduce of the block exponents (``numel / block`` int32s)
gives G for this step, identical on every rank and every rank count since it is a max over the
same micro-batch gradients:

* a block with inf/NaN (``G == NONFINITE_EXPONENT``): the step is skipped on every rank (grads
  set to ``None`` so ``opt.step()`` does nothing; ``on_nonfinite="raise"`` raises
  ``FloatingPointError`` naming the parameters, ``"nan"`` fills the grads with NaN for an AMP
  ``GradScaler`` to see);
* ``G > E`` somewhere (the gradient grew by more than ``2^margin``, or the very first step, which
  has no prediction): E becomes ``max(E, G)`` and the iterator replays this rank's micro-batches
  (the body runs again). No contribution has been committed across ranks yet, and the decision and
  the new exponents depend only on the global batch, so every rank count replays the same steps
  with the same exponents;
* otherwise the SUM all-reduce of the int64 accumulators (issued together with the MAX, so a
  step costs one round trip; its result is discarded on the rare steps above) is final:
  ``from_exact``, ``/ M``, cast.

All exponents are thus functions of the global batch history (and this module's state, see
:meth:`ExactGradAccumulator.state_dict`), never of the rank count. Contributions are rounded to the
grid ``2^(E - P)`` (P = 62 - headroom = 50 by default): values within ``P - 23 - margin`` binades
(23 by default) of their tensor's largest gradient of the previous step are exact, smaller ones are
rounded far below the fp32 resolution of that largest gradient; either way the result is the same
function of the global batch for every W. The alternatives cost more: storing every micro-batch
gradient to take the exact max first costs M gradient copies; two backward passes per step double
the compute on every step, not only on the rare steps whose gradient jumps.

**What the caller must keep identical across rank counts** (the per-micro-batch gradient must be
the same bits whichever rank computes it): the model's initial weights (seed before building it),
the micro-batch contents and shapes (fixed global batch, fixed split), the kernels (call
:func:`configure`: deterministic algorithms and a fixed intra-op thread count), and randomness
inside the forward (dropout): the iterator seeds the RNG for each micro-batch from
``(seed, step, micro-batch index)`` and restores it afterwards, so dropout masks do not depend on
the rank either. Per-rank state updated in forward (BatchNorm running statistics) is not covered.
"""
from __future__ import annotations

from .accumulator import ExactGradAccumulator, StepStats
from .determinism import configure

__all__ = ["ExactGradAccumulator", "StepStats", "configure"]
