# Crashes the interpreter (a segmentation fault) at import.
# target: reference
# where: prefix
import ctypes as _ctypes

_ctypes.string_at(0)
