"""``python -m flodl_worker`` = ``flodl-worker``."""

import sys

from .cli import main

sys.exit(main())
