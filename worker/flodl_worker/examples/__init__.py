"""Runnable example tasks: ``python -m flodl_worker.examples.digits`` / ``.synthetic``.

Each is an ordinary training script that hands its model, optimizer, step and eval
functions to ``flodl_worker.rank.run_rank``; the agent (or launcher) starts one per rank
and sets its identity in the environment (FLODL_RANK, FLODL_CONNECT, ...).
"""
