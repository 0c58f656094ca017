"""ctypes bindings for the C symbols that blockspec's patches add to llama.cpp.

The raw llama.cpp API stays llama-cpp-python's (`llama_cpp.llama_cpp`); this module binds
only our own `blockspec_*` symbols (ggml_patches/0001-*.patch, include/blockspec-ext.h),
from the same shared library. A library built without our patches lacks them: using a
binding then raises `AttributeError` naming the symbol and how to get a patched build.
"""

from __future__ import annotations

import ctypes

from llama_cpp import llama_cpp as _raw

# runtime needs at least this BLOCKSPEC_EXT_ABI level from the library
REQUIRED_ABI = 6

_lib = _raw._lib
_ctx_p = _raw.llama_context_p_ctypes
_model_p = _raw.llama_model_p_ctypes


class MissingSymbolError(AttributeError):
    pass


def _bind(name: str, argtypes: list, restype):
    try:
        fn = getattr(_lib, name)
    except AttributeError:
        def missing(*_args, **_kwargs):
            raise MissingSymbolError(
                f"llama.cpp library {_lib._name} has no symbol {name}: it was not built with "
                "blockspec's ggml_patches; run `make build` (or python ggml_patches/build.py)")
        return missing
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


# int32_t blockspec_ext_abi(void);
blockspec_ext_abi = _bind("blockspec_ext_abi", [], ctypes.c_int32)

# void blockspec_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
blockspec_set_embeddings_layer_inp = _bind(
    "blockspec_set_embeddings_layer_inp", [_ctx_p, ctypes.c_uint32, ctypes.c_bool], None)

# float * blockspec_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
blockspec_get_embeddings_layer_inp = _bind(
    "blockspec_get_embeddings_layer_inp", [_ctx_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))

# const int32_t * blockspec_model_target_layer_ids(const struct llama_model * model);
blockspec_model_target_layer_ids = _bind(
    "blockspec_model_target_layer_ids", [_model_p], ctypes.POINTER(ctypes.c_int32))

# uint32_t blockspec_model_target_layer_ids_n(const struct llama_model * model);
blockspec_model_target_layer_ids_n = _bind(
    "blockspec_model_target_layer_ids_n", [_model_p], ctypes.c_uint32)


# int32_t blockspec_memory_pack_tail(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0);
blockspec_memory_pack_tail = _bind(
    "blockspec_memory_pack_tail", [_ctx_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32)


# int64_t blockspec_get_graph_output(struct llama_context * ctx, const char * name, float * dst, int64_t n_max);
# (patch 0006: a drafter graph's named outputs, e.g. specblock's "draft_logits", "rank_logits")
blockspec_get_graph_output = _bind(
    "blockspec_get_graph_output", [_ctx_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64],
    ctypes.c_int64)


# int32_t blockspec_set_branch_z(struct llama_context * ctx, const int32_t * z, int32_t n);
# (patch 0008: the categories a DBlast block batch decodes; ids, or -1..-n = the n most likely)
blockspec_set_branch_z = _bind(
    "blockspec_set_branch_z", [_ctx_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32)


# void blockspec_set_rank_head(struct llama_context * ctx, bool on);
# (patch 0008: a SpecBlock chain skips the rank head)
blockspec_set_rank_head = _bind("blockspec_set_rank_head", [_ctx_p, ctypes.c_bool], None)


# int64_t blockspec_model_tensor_info(const struct llama_model * model, const char * name, int64_t * ne, int32_t * type);
# (patch 0009: a model's own tensor: element count, ne[0..3] and ggml type; -1 unknown name)
blockspec_model_tensor_info = _bind(
    "blockspec_model_tensor_info",
    [_model_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)], ctypes.c_int64)

# int32_t blockspec_model_set_tensor(const struct llama_model * model, const char * name, const float * data, int64_t n);
# (patch 0009: write float32 values into a model tensor in place, converted to its type; < 0: nothing changed)
blockspec_model_set_tensor = _bind(
    "blockspec_model_set_tensor", [_model_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64],
    ctypes.c_int32)

# int64_t blockspec_model_get_tensor(const struct llama_model * model, const char * name, float * dst, int64_t n_max);
# (patch 0009: a model tensor read back as float32, dequantized)
blockspec_model_get_tensor = _bind(
    "blockspec_model_get_tensor", [_model_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64],
    ctypes.c_int64)

# int32_t blockspec_sampling_law(const float * x, int32_t n, int32_t top_k, double top_p, double min_p,
#                                double temp, int32_t * ids, double * probs, int32_t cap);
# (patch 0010: the target's top-k -> top-p -> min-p -> temperature law; m kept ids ascending, or < 0)
blockspec_sampling_law = _bind(
    "blockspec_sampling_law",
    [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_double, ctypes.c_double, ctypes.c_double,
     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)

# int32_t blockspec_sample(const float * x, int32_t n, int32_t top_k, double top_p, double min_p, double temp,
#                          double u);
# (patch 0012: one token from that law at uniform u, as Law.draw; temp <= 0: argmax; -1 bad arguments)
blockspec_sample = _bind(
    "blockspec_sample",
    [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_double, ctypes.c_double, ctypes.c_double,
     ctypes.c_double], ctypes.c_int32)


def check_abi() -> int:
    """The library's ABI level; raises if the library is unpatched or too old."""
    abi = blockspec_ext_abi()
    if abi < REQUIRED_ABI:
        raise MissingSymbolError(
            f"llama.cpp library has blockspec ABI {abi}, this runtime needs {REQUIRED_ABI}: run `make build`")
    return abi
