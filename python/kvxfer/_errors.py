"""Result codes and the exceptions of the binding (no library needed)."""

import enum


class Result(enum.IntEnum):
    """kvxfer_result_t (include/kvxfer/kvxfer.h); errors are negative."""

    SUCCESS = 0
    IN_PROGRESS = 1
    ERR_INVALID_ARGUMENT = -1
    ERR_INVALID_USAGE = -2
    ERR_BUFFER_TOO_SMALL = -3
    ERR_NONFINITE = -4
    ERR_TRUNCATED = -5
    ERR_CORRUPT = -6
    ERR_MISMATCH = -7
    ERR_UNSUPPORTED = -8
    ERR_SYSTEM = -9
    ERR_INTERNAL = -10
    ERR_OUT_OF_MEMORY = -11
    ERR_TIMEOUT = -12
    ERR_CANCELLED = -13


def result_name(code):
    """'KVXFER_ERR_TIMEOUT' for -12; 'KVXFER_RESULT(<n>)' for an unknown code."""
    try:
        return "KVXFER_" + Result(code).name
    except ValueError:
        return "KVXFER_RESULT(%d)" % code


class KvxferError(Exception):
    """A kvxfer call failed.

    Attributes:
      code:        the kvxfer_result_t value (negative), as a Result when known
      name:        its C name, e.g. "KVXFER_ERR_TIMEOUT"
      description: kvxfer_get_error_string(code), e.g. "timeout"
      message:     kvxfer_get_last_error() read right after the failing call on
                   the calling thread (the detail: which field, which layer)
      function:    the C function that failed, e.g. "kvxfer_wait"
    """

    def __init__(self, code, message="", description="", function=""):
        try:
            code = Result(code)
        except ValueError:
            pass
        self.code = code
        self.name = result_name(int(code))
        self.description = description
        self.message = message
        self.function = function
        text = "%s%s (%s)" % (function + ": " if function else "", self.name,
                              description or "error")
        if message:
            text += ": " + message
        super().__init__(text)

    def __reduce__(self):  # picklable (multiprocessing)
        return (self.__class__, (int(self.code), self.message, self.description, self.function))


class LibraryNotFoundError(ImportError):
    """libkvxfer.so could not be found or loaded (see kvxfer._lib.find_library)."""
