"""Locate and load ``libraf_dist.so``, the C++ collective runtime (``src/``).

The library registers its functions with tvm-ffi under ``raf_dist.ccl.*`` when loaded, so
compiled Relax code can call them by name; this module also hands them to Python.
It is looked up next to this file (``pip install -e .`` puts it there), then under
``$RAF_DIST_LIBRARY_PATH``, then in ``build/`` of a source checkout.
"""
import ctypes
import functools
from pathlib import Path

_LIB_NAME = "libraf_dist.so"


def _candidates():
    here = Path(__file__).resolve().parent
    from .env import library_path

    given = library_path()
    if given:
        yield Path(given) / _LIB_NAME if Path(given).is_dir() else Path(given)
    yield here / _LIB_NAME
    yield here.parent.parent / "build" / _LIB_NAME


@functools.lru_cache(maxsize=None)
def load():
    """Load the native library once; raise with the fix if it was never built."""
    import tvm_ffi  # noqa: F401  (libtvm_ffi, which the library links, loads with it)

    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            # RTLD_GLOBAL: the library's MPI symbols must be the same instance mpi4py uses.
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            # the runtime raises TimeoutError by name (a collective past its deadline);
            # tvm_ffi maps unknown error kinds to RuntimeError, so tell it this one
            tvm_ffi.register_error("TimeoutError", TimeoutError)
            return str(path)
    raise ImportError(
        "raf_dist's native library was not found (looked at: " + ", ".join(tried) + "). "
        "Build it with `make install` (or `pip install -e .` in the source tree)."
    )


@functools.lru_cache(maxsize=None)
def func(name):
    """The native global function ``raf_dist.ccl.<name>``."""
    # imported here, not at the top: raf_dist.run imports the package (tvm_ffi took 1-4 s to
    # import on this machine) and must be up, with its signal handlers, at once
    import tvm_ffi

    load()
    return tvm_ffi.get_global_func("raf_dist.ccl." + name)
