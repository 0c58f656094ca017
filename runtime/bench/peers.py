"""Upstream llama.cpp's speculative decoding as a peer in `blockspec bench`.

The peer is upstream's own `llama-speculative-simple` (examples/speculative-simple), built by
ggml_patches/build_tools.py from the same pinned, patched source and with the same ggml flags as
the wheel our engine runs on; it is found under $BLOCKSPEC_CACHE/tools/<wheel key>/bin, where
<wheel key> is the installed wheel's (llama_cpp/blockspec_build.json).

One process per prompt. The prompt is our chat-template rendering of the messages, passed with
`-p` and `--no-escape` (`-f` would drop the template's final newline); the tool tokenizes it with
special tokens parsed and BOS added when the vocab asks for it, which `peer_prompt` checks gives
the same token sequence as our runtime. Settings mapped: `--temp` (0 = greedy), top-k/top-p/min-p/
repeat penalty, `--seed`, `-t`/`-tb` (our thread count), `-c` (our n_ctx), `-fa on` (our target
runs flash attention), `-b` = n_ctx (the tool refuses a prompt longer than one batch). The tool
runs as users run it: on upstream's default kernels, our environment's GGML_BATCH_INVARIANT and
BLOCKSPEC_* variables stripped (our engine keeps the batch-invariant kernels that make its
verification bit-exact; the bench states each row's kernel mode).

What is read from its output (`-lv 4` adds the per-drafter statistics line at trace level):
- generated text: stdout after the echoed prompt (the tool prints "\\n\\n", every prompt token's
  piece, then every accepted token's piece, then two more "\\n\\n");
- `decoded N tokens in S seconds`: N = generated tokens (n_predict), S = the tool's own timing of its
  generation loop. tokens_per_s = N / S. That loop starts with the target pass over the LAST prompt
  token (our engine counts that pass as prefill), so for equal work the peer's figure is low by
  about one pass in N (< 1% at 128 tokens);
- `n_accept`: tau = N / (N - n_accept), i.e. generated tokens per target pass of that loop;
- the drafter's `#calls(b,g,a)` and `#acc rate/pos` give the accepted-length histogram: of the `a`
  passes that verified a draft, round(rate[i] * a) accepted at least i+1 tokens; the other
  N - n_accept - a passes verified no draft (histogram bin 0).
It generates until it has MORE than -n tokens (its loop stops on n_predict > -n), so it may emit a
few tokens past --max-tokens; rates are per token, and losslessness compares prefixes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.llama.target import installed_build

TOOL = "llama-speculative-simple"


def tools_bin_dir() -> Path | None:
    """Where build_tools.py puts upstream's binaries for the installed wheel (None: no stamp)."""
    from blockspec.runtime.format.modelfile import cache_dir

    key = installed_build().get("key")
    return cache_dir() / "tools" / key / "bin" if key else None


def find_tool(name: str = TOOL) -> Path:
    d = tools_bin_dir()
    if d is None:
        raise BlockspecError("the installed llama-cpp-python has no blockspec build stamp: run `make build`")
    path = d / name
    if not path.is_file():
        raise BlockspecError(f"upstream tool {name} is not built for this wheel: run "
                             "`python ggml_patches/build_tools.py` (or `make bench`)")
    return path


def peer_prompt(target, text: str, tokens: list[int]) -> str:
    """The text to hand the tool so that its tokenization (special tokens parsed, BOS added if the
    vocab says so) is exactly `tokens`; raise BlockspecError when no such text is found."""
    if target.tokenize(text, add_special=True, parse_special=True) == tokens:
        return text
    bos_text = target.token_text(target.bos)
    if bos_text and text.startswith(bos_text):
        stripped = text[len(bos_text):]
        if target.tokenize(stripped, add_special=True, parse_special=True) == tokens:
            return stripped
    raise BlockspecError("the upstream tool would tokenize this prompt differently from our runtime")


@dataclass
class PeerSpec:
    """How one upstream method is invoked: its --spec-type and extra flags. `{block_size}` in an
    argument is filled in; `needs_drafter` means a -md GGUF from --drafter METHOD=PATH."""

    spec_type: str  # "": the tool takes no --spec-type (llama-lookup)
    args: tuple[str, ...] = ()
    needs_drafter: bool = False
    # `-lcs FILE`: upstream's static n-gram cache (llama-lookup-create's format) made from our answer
    # store (--drafter METHOD=STORE, default the shipped one), so both engines draft from the same answers
    needs_store: bool = False
    tool: str = TOOL


@dataclass
class PeerResult:
    text: str
    n_tokens: int
    gen_s: float
    tau: float
    target_passes: int
    accept_hist: list[int] = field(default_factory=list)
    finish_eos: bool = False
    drafted: int | None = None  # drafted tokens the tool verified (its n_drafted)


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_N_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_N_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_CALLS = re.compile(r"#calls\(b,g,a\)\s*=\s*(\d+)\s+(\d+)\s+(\d+)")
_RATES = re.compile(r"#acc rate/pos = \(([^)]*)\)")


def parse_stats(stderr: str) -> tuple[int, float, int, list[int]]:
    """(n_predict, decode seconds, n_accept, accept histogram) from the tool's log."""
    m = _DECODED.search(stderr)
    a = _N_ACCEPT.search(stderr)
    if not m or not a:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise BlockspecError(f"the upstream tool printed no generation stats: {tail}")
    n_predict, secs, n_accept = int(m.group(1)), float(m.group(2)), int(a.group(1))
    passes = n_predict - n_accept
    hist = [passes]
    c, r = _CALLS.search(stderr), _RATES.search(stderr)
    if c and r and r.group(1).strip():
        n_calls = int(c.group(3))
        at_least = [round(float(x) * n_calls) for x in r.group(1).split(",")]  # passes with >= i+1 accepted
        at_least.append(0)
        hist = [passes - at_least[0]] + [at_least[i] - at_least[i + 1] for i in range(len(at_least) - 1)]
    return n_predict, secs, n_accept, hist


def peer_env() -> dict:
    """Our environment without the variables that switch our kernels (upstream runs its defaults)."""
    return {k: v for k, v in os.environ.items() if k != "GGML_BATCH_INVARIANT" and not k.startswith("BLOCKSPEC_")}


def run_peer(tool: Path, spec: PeerSpec, *, model: Path, prompt_text: str, echo: bytes, max_tokens: int,
             sampling, seed: int, threads: int, n_ctx: int, block_size: int, drafter: str | None,
             timeout: float) -> PeerResult:
    """One generation with the upstream tool; raises BlockspecError with one line on failure."""
    if (spec.needs_drafter or spec.needs_store) and not drafter:
        raise BlockspecError(f"--spec-type {spec.spec_type} needs a draft GGUF: --drafter METHOD=PATH")
    cmd = [str(tool), "-m", str(model), "-p", prompt_text, "--no-escape", "-n", str(max_tokens),
           "-c", str(n_ctx), "-b", str(n_ctx), "-ub", "512", "-t", str(threads), "-tb", str(threads),
           "-fa", "on", "-lv", "4", *(("--spec-type", spec.spec_type) if spec.spec_type else ()),
           "--temp", str(sampling.temperature), "--top-k", str(sampling.top_k), "--top-p", str(sampling.top_p),
           "--min-p", str(sampling.min_p), "--repeat-penalty", str(sampling.repeat_penalty), "--seed", str(seed)]
    cmd += [a.format(block_size=block_size) for a in spec.args]
    if drafter and spec.needs_store:
        cmd += ["-lcs", str(static_lookup_cache(drafter))]
    elif drafter:
        cmd += ["-md", str(drafter)]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, timeout=timeout, env=peer_env())
    except subprocess.TimeoutExpired:
        raise BlockspecError(f"{tool.name} did not finish in {timeout:.0f} s") from None
    err = res.stderr.decode("utf-8", "replace")
    if res.returncode != 0:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower() or "failed" in ln.lower()),
                   lines[-1] if lines else f"exit {res.returncode}")
        raise BlockspecError(f"{tool.name} exited {res.returncode}: {why.strip()[:200]}")
    n_predict, secs, n_accept, hist = parse_stats(err)
    out = res.stdout
    head = b"\n\n" + echo
    if not out.startswith(head):
        raise BlockspecError(f"{tool.name} did not echo the prompt as expected (after {time.perf_counter() - t0:.0f} s)")
    body = out[len(head):]
    body = body[:-4] if body.endswith(b"\n\n\n\n") else body
    passes = max(1, n_predict - n_accept)
    drafted = _N_DRAFTED.search(err)
    return PeerResult(text=body.decode("utf-8", "replace"), n_tokens=n_predict, gen_s=secs,
                      tau=n_predict / passes, target_passes=passes, accept_hist=hist,
                      finish_eos=n_predict <= max_tokens, drafted=int(drafted.group(1)) if drafted else None)


def static_lookup_cache(store_path: str | os.PathLike) -> Path:
    """Upstream's static n-gram cache (`llama-lookup-create`'s file: every 2-gram of the text with the
    counts of the tokens that follow it; common/ngram-cache.cpp) of an answer store's token text,
    written once per store version under the cache dir. The same answers our store drafts from."""
    import hashlib
    import struct
    from collections import Counter

    import numpy as np

    from blockspec.runtime.drafters.store import SEP, read_store
    from blockspec.runtime.format.modelfile import cache_dir

    p = Path(store_path)
    st = p.stat()
    key = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "lookup" / f"{key}.bin"
    if out.is_file():
        return out
    t = read_store(p)[0]
    ok = (t[:-2] != SEP) & (t[1:-1] != SEP) & (t[2:] != SEP)
    counts: dict[tuple[int, int], Counter] = {}
    for a, b, c in zip(t[:-2][ok].tolist(), t[1:-1][ok].tolist(), t[2:][ok].tolist()):
        counts.setdefault((a, b), Counter())[c] += 1
    buf = bytearray()
    for (a, b), part in counts.items():
        buf += struct.pack("<4ii", a, b, -1, -1, len(part))
        buf += np.array([x for kv in part.items() for x in kv], np.int32).tobytes()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(bytes(buf))
    os.replace(tmp, out)
    return out
