"""The one way a converter writes a GGUF: to a temp file beside the target, moved into place only
when complete, so an error or Ctrl-C never leaves a half-written file under the real name."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def gguf_writer(out_path: str | os.PathLike, arch: str) -> Iterator:
    """`with gguf_writer(out, arch) as w:` add keys and tensors to `w` (a gguf.GGUFWriter); on a
    clean exit the file is written and renamed to `out`, otherwise the temp file is removed."""
    import gguf

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        yield w
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
