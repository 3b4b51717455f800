"""ctest's entry point for the Python binding's tests:
    python3 run_pytest.py <pytest arguments...>
Exits 77 (ctest SKIP_RETURN_CODE) when pytest is not installed for this
interpreter (scripts/install-deps.sh installs it), else pytest's status."""

import sys

try:
    import pytest
except ImportError:
    print("pytest is not installed for %s: run scripts/install-deps.sh, or "
          "'%s -m pip install pytest'; skipping" % (sys.executable, sys.executable))
    sys.exit(77)

sys.exit(pytest.main(sys.argv[1:]))
