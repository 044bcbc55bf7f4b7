# Ends the process with os._exit(0) at import, no exception to catch.
# target: reference
# where: prefix
import os as _os

_os._exit(0)
