"""The backends' shared test helpers (``batches.py``: explicit placements over a paged pool) importable from the
CPU and the CUDA tests alike."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
