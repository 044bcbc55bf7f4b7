import os
import sys

# The technique files live at the repository root and the harness beside this file; both import by name.
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)
