"""The planned allocator's tests need its C++ core compiled (once, cached)."""

import pytest

from memplan.native import missing_build_tools


@pytest.fixture(scope="session")
def ext():
    missing = missing_build_tools()
    if missing:
        pytest.skip(f"cannot build the planned allocator here: missing {', '.join(missing)}")
    from memplan.runtime.build import cpu_extension

    return cpu_extension()
