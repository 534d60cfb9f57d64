import os
import sys
from pathlib import Path

from hypothesis import settings

# Tests name custom models as ``factories:NAME``; make that module importable.
sys.path.insert(0, str(Path(__file__).parent))

# CI runs the same examples every time; local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
