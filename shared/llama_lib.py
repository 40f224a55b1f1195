"""Loading llama.cpp's bindings (``llama-cpp-python``), once per process, with llama.cpp's own log
routed to ours. Apart from the runner (``shared.runner.llama``) so that what only asks whether
llama.cpp is here (`specfleet up`, the GGUF copies) loads no framework: this imports nothing heavy."""

from __future__ import annotations

import ctypes
from typing import Any

from shared.errors import ModelLoadError
from shared.log import get_logger

log = get_logger("runner.llama")
INSTALL_HINT = ("pip install 'llama-cpp-python==0.3.36' (built from its source on PyPI: about 5 minutes on 2 cores; "
                "`make install` does it)")
_LOG_WARN = 3  # ggml_log_level: GGML_LOG_LEVEL_WARN; ERROR is 4, CONT (a continued line) 5
_DEVICE_GPU, _DEVICE_IGPU = 1, 2  # ggml_backend_dev_type: CPU 0, GPU 1, IGPU 2 (a Jetson's), ACCEL 3


def llama_cpp_module() -> Any:
    """The low-level ``llama_cpp`` bindings, initialised, or ModelLoadError saying how to install them."""
    try:
        from llama_cpp import llama_cpp as lib
    except ImportError as exc:
        raise ModelLoadError(f"GGUF drafts run on llama.cpp, which is not installed ({exc}): {INSTALL_HINT}") from None
    _init_backend(lib)
    return lib


def llama_cpp_available() -> bool:
    try:
        llama_cpp_module()
    except ModelLoadError:
        return False
    return True


_backend: dict[str, Any] = {}


def _init_backend(lib: Any) -> None:
    """Once per process: the backend, and llama.cpp's own log routed to ours (warnings and errors)."""
    if _backend:
        return
    def relay(level: int, text: bytes, _: Any) -> None:
        if level in (_LOG_WARN, _LOG_WARN + 1) and text and text.strip():
            log.warning("llama.cpp says", message=text.decode(errors="replace").strip())

    _backend["callback"] = lib.llama_log_callback(relay)  # kept alive as long as the process
    lib.llama_log_set(_backend["callback"], ctypes.c_void_p(0))
    lib.llama_backend_init()


def gpu_present(lib: Any) -> bool:
    """Whether llama.cpp sees a GPU here (a CUDA build on a host without one does not): then it
    offloads every layer. A build that cannot tell says whether it could offload at all."""
    try:
        from llama_cpp._ggml import libggml

        count, get, kind = libggml.ggml_backend_dev_count, libggml.ggml_backend_dev_get, libggml.ggml_backend_dev_type
        count.restype, get.restype, get.argtypes = ctypes.c_size_t, ctypes.c_void_p, [ctypes.c_size_t]
        kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
        return any(kind(get(i)) in (_DEVICE_GPU, _DEVICE_IGPU) for i in range(count()))
    except (ImportError, AttributeError, OSError):
        return bool(lib.llama_supports_gpu_offload())
