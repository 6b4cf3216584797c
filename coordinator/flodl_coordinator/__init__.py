"""flodl-coordinator: the service shell around ``flodl.core``.

One ZeroMQ ROUTER, one loop, the deterministic core, the bus reducer, a journal of
every decoded event, and an HTTP status endpoint.
"""

__version__ = "0.1.0"
