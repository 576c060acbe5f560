"""Shared by the llama.cpp peer scripts (run by the peer's interpreter, never imported by fuel)."""


def avoid_amx() -> bool:
    """Turn off llama.cpp's extra weight buffers (its AMX path) where the CPU advertises AMX:
    on this machine's VM, ``ldtilecfg`` in ``ggml_backend_amx_mul_mat`` crashes the process
    (SIGSEGV in the first ``eval``), so llama.cpp runs its AVX2/AVX-512 kernels, as it does on
    any CPU without AMX. Returns whether it did."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    if "amx_tile" not in flags:
        return False
    import llama_cpp.llama_cpp as api

    default = api.llama_model_default_params

    def params():
        value = default()
        value.use_extra_bufts = False
        return value

    api.llama_model_default_params = params
    return True

