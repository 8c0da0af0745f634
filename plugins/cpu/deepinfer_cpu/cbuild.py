"""Building the plugin's C kernels (``csrc/*.c``) once per machine with the system C compiler.

A kernel is compiled on first use (``FLAGS``) into ``<deepinfer cache>/cpu_kernels/`` under a name hashed
from its sources (and ``csrc``'s headers), the flags and the compiler, so a machine builds each version once
(under a second) and loads it through ctypes; a failed build raises with the compiler's message. A library
may link several sources (``decode_step.c`` calls the kernels of ``gemv.c``, ``paged_attention.c`` and
``quant_linear.c``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from deepinfer.ops import cache_dir

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")  # no errno: expf vectorizes


def compiler() -> str | None:
    """The C compiler the kernels are built with (``$CC``, else cc / gcc / clang on PATH)."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_library(source: Path | Sequence[Path], march: str = "native") -> ctypes.CDLL:
    """``source`` (one file, or several linked into one library, named after the first) compiled into the
    cache (once per sources, flags and compiler) and loaded. ``march`` other than ``native`` (e.g.
    ``x86-64-v2``: no AVX-512) builds the kernels' portable paths, for tests."""
    sources = [source] if isinstance(source, Path) else list(source)
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"plugins.cpu: the {sources[0].name} kernel needs a C compiler (cc, gcc or clang)")
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)
    # the headers the sources include (csrc/*.h) are part of what is built
    text = b"".join(f.read_bytes() for f in [*sources, *sorted(CSRC.glob("*.h"))])
    key = hashlib.sha256(text + " ".join((cc, *flags)).encode()).hexdigest()[:16]
    target = cache_dir() / "cpu_kernels" / f"{sources[0].stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            run = subprocess.run([cc, *flags, "-o", str(built), *map(str, sources), "-lm"], capture_output=True,
                                 text=True)
            if run.returncode != 0:
                raise RuntimeError(f"plugins.cpu: building {sources[0].name} with {cc} failed:\n{run.stderr.strip()}")
            os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    return ctypes.CDLL(str(target))
