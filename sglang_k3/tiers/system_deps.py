"""What the Mooncake tier needs from the machine, and the error a user sees when a piece is missing.

The Mooncake wheel (``mooncake-transfer-engine-non-cuda``, in the ``mooncake``, ``fleet`` and
``test`` extras) ships its own copies of most libraries, but its ``mooncake_master`` binary and its
Python store client (``mooncake.store``) are linked against a few system libraries it does not
ship: libibverbs (RDMA verbs; loaded even when the transport is TCP), libnuma and libcurl. Without
libibverbs the master exits with 127 and the client's import fails, each with the loader's one-line
message buried in a log. Every entry point that starts a master or a client (``start_fleet.py``,
``start_mooncake_master.py``, ``launch_server --k3-mooncake``, the store holder) goes through
:func:`store_client_class` or :meth:`MooncakeMaster.start
<sglang_k3.tiers.mooncake_master.MooncakeMaster.start>`, which raise :class:`MissingDependency`
naming what is missing and the command that installs it.

Torch-free and Mooncake-free: importing this module never loads the wheel.
"""

from __future__ import annotations

import re
from typing import Optional

# The system libraries the wheel's binaries link against (``ldd`` of ``mooncake/store.so`` and
# ``mooncake/mooncake_master`` in 0.3.13.post1, less glibc and what the wheel bundles), each with
# the Debian/Ubuntu package that provides it.
SYSTEM_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
}
WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
WHEEL_FIX = f'pip install "{WHEEL}" (or install sglang-k3 with the mooncake extra: pip install -e ".[mooncake]")'

# The loader's message, as ld.so prints it for a binary ("error while loading shared libraries:
# X: cannot open shared object file") and as Python's ImportError carries it ("X: cannot open
# shared object file: No such file or directory").
_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]*\.so[\w.]*): cannot open shared object file")


class MissingDependency(RuntimeError):
    """A piece of the machine the Mooncake tier needs is missing. ``fix`` is the command (or
    instruction) that installs it; the message says both."""

    def __init__(self, what: str, missing: str, fix: str) -> None:
        self.what, self.missing, self.fix = what, missing, fix
        super().__init__(f"{what} cannot start: {missing} is missing. Fix: {fix}")


def install_command(library: str) -> str:
    """The command that installs the system library ``library`` (a soname)."""
    package = SYSTEM_PACKAGES.get(library)
    if package is not None:
        return f"apt-get install -y {package}"
    return f"install the system package that provides {library} (Debian/Ubuntu: apt-file search {library})"


def missing_library(text: str) -> Optional[str]:
    """The soname the dynamic loader could not find, if ``text`` (a log, an ImportError's message)
    carries its message; else None."""
    m = _MISSING_LIBRARY.search(text)
    return m.group(1) if m else None


def raise_if_missing_library(what: str, text: str) -> None:
    """:class:`MissingDependency` for ``what`` when ``text`` (a process's log, an ImportError's
    message) carries the loader's message for a missing system library; else nothing."""
    library = missing_library(text)
    if library is not None:
        err = MissingDependency(what, f"the system library {library}", install_command(library))
        err.__suppress_context__ = True  # as ``raise ... from None``: the loader's error is in the message
        raise err


def store_client_class(what: str = "the Mooncake store client"):
    """``mooncake.store.MooncakeDistributedStore``, or :class:`MissingDependency` saying whether
    the wheel or one of its system libraries is missing, and how to install it."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "mooncake":
            raise
        raise MissingDependency(what, "the Mooncake wheel", WHEEL_FIX) from None
    except ImportError as e:
        raise_if_missing_library(what, str(e))
        raise
    return MooncakeDistributedStore
