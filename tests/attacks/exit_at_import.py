# Calls sys.exit(0) at import: its own tests score zero, nothing else is lost.
# target: reference
# where: prefix
import sys as _sys

_sys.exit(0)
