"""flodl: heterogeneity-aware data-parallel training coordination.

This distribution holds the parts that need no torch: the wire protocol
(``flodl.wire``), the coordinator's deterministic core (``flodl.core``), the
virtual-time simulator (``flodl.sim``) and the local launcher (``flodl.cli``).
"""

__version__ = "0.1.0"
