"""Tools built on flatcomm, shipped with it but apart from the library (the library never imports them):

* :mod:`flatcomm.tools.bench`: ``python -m flatcomm.bench {kernels,collectives,ddp,fsdp}`` and the
  benchmark code it runs;
* :mod:`flatcomm.tools.tune`: ``python -m flatcomm.tune``, the codec autotuner's decision table (the
  engine is :mod:`flatcomm.autotune`);
* :mod:`flatcomm.tools.demo`: ``python -m flatcomm.demo``, DDP training with every codec;
* :mod:`flatcomm.tools.netlink`: ranks in network namespaces behind a shaped link (root only);
* :mod:`flatcomm.tools.spawn`: run a function on N local gloo ranks (tests, benchmarks, demo);
* :mod:`flatcomm.tools.hardening`: ``python -m flatcomm.tools.hardening {fuzz,kills}``, a random-argument
  fuzz of the collectives and SIGKILLs of a peer mid two-level call.
"""
