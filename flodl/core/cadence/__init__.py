"""The Cadence and Async policies and their engines (ports of the upstream ElChe family).

Theory of operation
-------------------
``flodl.core``'s protocol modules see these policies only through ``_policy.Policy``
(its dispatcher, gate and switches); the step reaches ``_feedback`` for the calibration
the Fastest election waits for. Inside the package:

* ``_dispatcher`` -- the Cadence dispatcher: chunk pool, windows, the reduce budget, wake;
* ``_async`` -- the Async dispatcher (streams epochs; a subclass of the Cadence one);
* ``_feedback`` -- the end of a round: ElChe calibration, the guard, the window notice;
* ``_slack`` -- the Cadence gate's slack and straggler accounting;
* ``_elche``, ``_chunk_pool``, ``_window``, ``_guards``, ``_lr_meta``, ``_overshoot`` --
  the engines (the upstream ports).

Nothing here registers itself at import time; importing the package imports nothing.
"""
