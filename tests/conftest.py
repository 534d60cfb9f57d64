import sys
from pathlib import Path

# Tests name custom models as ``factories:NAME``; make that module importable.
sys.path.insert(0, str(Path(__file__).parent))
