"""flodl_worker.plans: the work a rank was given (``flodl.rank.Chunk``, re-exported).

The rank machine (``flodl.rank``) owns the plans; this name stays for the tools that
import it from here.
"""

from __future__ import annotations

from flodl.rank import Chunk

__all__ = ["Chunk"]
