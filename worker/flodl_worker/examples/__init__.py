"""Runnable example tasks: ``python -m flodl_worker.examples.<name>``.

- ``digits`` / ``synthetic``: an MLP on scikit-learn's digits / a generated task (the
  ``flodl run --task`` shortcuts);
- ``cnn``: conv + BatchNorm + dropout on the digits as 1x8x8 images;
- ``tinylm``: a tiny causal transformer language model on generated sequences
  (held-out loss, perplexity, next-token accuracy).

Each is an ordinary training script that hands its model, optimizer, step and eval
functions to ``flodl_worker.rank.run_rank``; the agent (or launcher) starts one per rank
and sets its identity in the environment (FLODL_RANK, FLODL_CONNECT, ...):
``flodl run --local --ranks 3 -- python -m flodl_worker.examples.cnn``.
"""
