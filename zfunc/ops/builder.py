"""Just-in-time builds of the C++/CUDA extensions in ``csrc/``.

``load(name, sources, ...)`` compiles once per process (cached in torch's
extensions directory, so later processes only load the shared object) and
returns the module, or ``None`` with the reason recorded so the caller can fall
back to plain PyTorch. ``report()`` lists every op asked for and what happened.
A build is keyed by what is built (the sources' and headers' contents, flags,
torch, Python and compiler), never by where the sources are: it compiles its own
copy of them, so any number of checkouts share one build, and a changed source
builds anew.

Environment:
  ``ZFUNC_OPS_DISABLE``  ``1``/``all`` disables every op; a comma list of op
                         names disables those.
  ``CXX``                the C++ compiler (as torch's builder uses it).
  ``ZFUNC_OPS_ISA``     ``avx2`` or ``none`` caps the vector flags (default: the
                         widest this CPU has, read from /proc/cpuinfo).
  ``ZFUNC_OPS_VERBOSE``  ``1`` shows the compiler's output.
  ``TORCH_EXTENSIONS_DIR`` where builds are cached.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Sequence

def _sources_dir() -> Path:
    """The C++/CUDA sources: ``zfunc/_csrc`` in an installed wheel (package data),
    the repository's ``csrc/`` in a checkout or an editable install."""
    here = Path(__file__).resolve().parents[1]
    installed = here / "_csrc"
    return installed if installed.is_dir() else here.parent / "csrc"


CSRC = _sources_dir()

_lock = threading.RLock()
_results: dict[str, dict[str, Any]] = {}
_modules: dict[str, Any] = {}


_NO_CUDA = "CUDA not available to torch"


class OpBuildWarning(UserWarning):
    """An op could not be built; zfunc falls back to plain PyTorch."""


# ---------------------------------------------------------------- the machine

def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports in /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_cflags(flags: frozenset[str] | None = None) -> list[str]:
    """Compiler flags for the widest vector ISA this CPU supports (x86 only).

    ``ZFUNC_OPS_ISA=avx2`` or ``=none`` caps the choice (for a build cache shared
    by different machines, or to test the portable code paths).
    """
    flags = cpu_flags() if flags is None else flags
    cap = os.environ.get("ZFUNC_OPS_ISA", "native").strip().lower()
    if cap in ("none", "plain", "generic"):
        return []
    if cap == "avx2":
        flags = flags - {"avx512f"}
    elif cap not in ("", "native", "avx512"):
        raise ValueError(f"ZFUNC_OPS_ISA={cap!r}: expected native, avx512, avx2 or none")
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        out = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]
        if "avx512_bf16" in flags:
            out.append("-mavx512bf16")
        # 512-bit registers for the kernels we write with intrinsics; let gcc's
        # own loops use them too.
        return out + ["-mprefer-vector-width=512"]
    if {"avx2", "fma"} <= flags:
        return ["-mavx2", "-mfma"] + (["-mf16c"] if "f16c" in flags else [])
    return []


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def _disabled(name: str) -> bool:
    value = os.environ.get("ZFUNC_OPS_DISABLE", "").strip().lower()
    if not value or value in ("0", "false", "no"):
        return False
    if value in ("1", "all", "true", "yes"):
        return True
    return name.lower() in {v.strip() for v in value.split(",")}


@functools.lru_cache(maxsize=None)
def _probe(cxx: str, code: str, args: tuple[str, ...]) -> str | None:
    """Compile (and link, unless ``-c`` is in args) a tiny program; the error or None."""
    with tempfile.TemporaryDirectory(prefix="zfunc_probe_") as d:
        src = Path(d) / "probe.cpp"
        src.write_text(code)
        cmd = [cxx, str(src), "-o", str(Path(d) / "probe.out"), *args]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return str(e)
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
            if not lines:
                return f"exit status {r.returncode}"
            first = next((ln for ln in lines if "error" in ln), lines[0])
            return first.split(str(src) + ":", 1)[-1].strip()
    return None


def _python_include() -> Path:
    return Path(sysconfig.get_paths()["include"])


def _precheck(name: str, sources: Sequence[str], cflags: Sequence[str],
              ldflags: Sequence[str], required_headers: Sequence[str],
              required_libs: Sequence[str], cuda: bool) -> str | None:
    """Why the op cannot be built here, or None if it looks buildable."""
    if _disabled(name):
        return "disabled by ZFUNC_OPS_DISABLE"
    cxx = _cxx()
    if shutil.which(cxx) is None:
        return f"C++ compiler {cxx!r} not found (set CXX or install g++)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    if not (_python_include() / "Python.h").exists():
        return f"Python.h not found in {_python_include()} (install python3-dev)"
    missing = [s for s in sources if not (CSRC / s).is_file()]
    if missing:
        return f"source {missing[0]!r} not found under {CSRC}"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            return _NO_CUDA + " (torch.cuda.is_available() is False)"
        if torch.version.cuda is None:
            return "this torch build has no CUDA support"
        if cpp_extension.CUDA_HOME is None or shutil.which(
                os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")) is None:
            return "nvcc not found (set CUDA_HOME)"
    for flag in [f for f in cflags if f.startswith("-m")] + (
            ["-fopenmp"] if "-fopenmp" in cflags else []):
        err = _probe(cxx, "int main() { return 0; }\n", (flag, "-c"))
        if err:
            return f"compiler {cxx!r} rejects {flag}: {err}"
    for header in required_headers:
        err = _probe(cxx, f"#include <{header}>\nint main() {{ return 0; }}\n",
                     ("-fsyntax-only", *_include_flags(cflags)))
        if err:
            return f"header {header!r} not found ({err})"
    for lib in required_libs:
        err = _probe(cxx, "int main() { return 0; }\n",
                     (*[f for f in ldflags if f.startswith("-L")], f"-l{lib}"))
        if err:
            return f"library {lib!r} not found (cannot link -l{lib}: {err})"
    return None


def _include_flags(flags: Sequence[str]) -> list[str]:
    return [f for f in flags if f.startswith(("-I", "-D"))]


def _ext_name(name: str, cflags: Sequence[str], ldflags: Sequence[str], cuda: bool, sources: str = "") -> str:
    """Module name, and so its build folder: op name plus a hash of everything that changes the
    binary (torch and Python versions, compiler, flags, ``sources``: the digest of what is compiled),
    and of nothing else: two copies of the same sources share one build."""
    import torch

    key = "\0".join([torch.__version__, sys.version, _cxx(), str(cuda), *cflags, "|", *ldflags, "|", sources])
    return f"zfunc_{name}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"


_HEADERS = (".h", ".hh", ".hpp", ".cuh", ".inc")


def _build_files(sources: Sequence[str]) -> tuple[dict[str, Path], list[str], str]:
    """``(files, compiled, digest)``: every file a build of ``sources`` reads from the source tree (the
    sources and every header under ``csrc/``), by its name in the build's own copy; the names of the
    compiled ones, in order; and a digest of the names and contents of them all."""
    files: dict[str, Path] = {}
    compiled = []
    for i, s in enumerate(sources):
        path = CSRC / s
        rel = s if not Path(s).is_absolute() else f"_given/{i}/{path.name}"  # outside csrc/
        files[rel] = path
        compiled.append(rel)
    for h in sorted(CSRC.rglob("*")):
        if h.suffix in _HEADERS and h.is_file():
            files.setdefault(h.relative_to(CSRC).as_posix(), h)
    digest = hashlib.sha1()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + files[rel].read_bytes() + b"\0")
    return files, compiled, digest.hexdigest()


def _snapshot(build_dir: Path, files: dict[str, Path]) -> Path:
    """The build's own copy of its sources, in its build folder (made once, under the build lock):
    torch records the paths it compiles, so every checkout that builds from this copy finds the
    build up to date, where builds from each checkout's own path would redo each other's."""
    out = build_dir / "src"
    if not out.is_dir():
        tmp = build_dir / f"src.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, path in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp / rel)
        os.rename(tmp, out)
    return out


def _short(err: BaseException) -> str:
    text = str(err).strip()
    lines = [ln for ln in text.splitlines() if "error:" in ln.lower()] or [
        ln for ln in text.splitlines() if "error" in ln.lower()]
    msg = (lines[0] if lines else (text.splitlines() or [type(err).__name__])[-1]).strip()
    return f"{type(err).__name__}: {msg[:400]}"


# -------------------------------------------------------------------- public

def load(name: str, sources: Sequence[str], *, extra_cflags: Sequence[str] = (),
         extra_ldflags: Sequence[str] = (), required_headers: Sequence[str] = (),
         required_libs: Sequence[str] = (), cuda: bool = False, quiet: bool = False):
    """Build (or load the cached build of) op ``name``.

    ``sources`` are paths relative to ``csrc/``. Returns the compiled module, or
    ``None`` when it cannot be built here; the reason is recorded (see
    ``report()``) and announced once with an ``OpBuildWarning`` (``quiet``: not
    announced, for an op that is one of several alternatives whose caller says
    which it took). The result is cached per process: asking again returns the
    same module (or ``None``).
    """
    with _lock:
        if name in _results:
            return _modules.get(name)
        cflags = ["-O3", "-fno-math-errno", "-fno-trapping-math"]
        ldflags: list[str] = []
        if not cuda or any(s.endswith((".cpp", ".cc")) for s in sources):
            cflags += ["-fopenmp", *isa_cflags()]
            ldflags.append("-fopenmp")
        cflags += list(extra_cflags)
        ldflags += list(extra_ldflags)
        row = {"name": name, "built": False, "reason": "", "flags": " ".join(cflags),
               "cuda": cuda, "module": None}
        reason = _precheck(name, sources, cflags, ldflags, required_headers,
                           required_libs, cuda)
        module = None
        if reason is None:
            from torch.utils import cpp_extension

            try:
                files, compiled, digest = _build_files(sources)
                ext = _ext_name(name, cflags, ldflags, cuda, digest)
                with _build_lock(ext) as build_dir:
                    _announce_build(name, ext)
                    src = _snapshot(build_dir, files)
                    module = cpp_extension.load(
                        name=ext,
                        sources=[str(src / rel) for rel in compiled],
                        extra_cflags=cflags,
                        extra_cuda_cflags=["-O3", "-lineinfo"] if cuda else None,
                        extra_ldflags=ldflags,
                        extra_include_paths=[str(src)],
                        with_cuda=cuda,
                        verbose=os.environ.get("ZFUNC_OPS_VERBOSE", "") not in ("", "0"),
                    )
                row["module"] = ext
            except Exception as e:  # a failed compile or load: fall back, say why
                reason = f"build failed: {_short(e)}"
        if module is not None:
            row.update(built=True, reason="built")
            _modules[name] = module
        else:
            row["reason"] = reason or "unknown"
            # Asked-for fallbacks (disabled, no GPU here) are recorded, not announced.
            if not quiet and not row["reason"].startswith(("disabled", _NO_CUDA)):
                warnings.warn(f"zfunc op {name!r} not built, using the PyTorch fallback: "
                              f"{row['reason']}", OpBuildWarning, stacklevel=2)
        _results[name] = row
        return module


@contextlib.contextmanager
def _build_lock(ext: str):
    """Hold an OS lock on the build directory while torch builds or loads there.

    torch's own lock is a file that a killed build leaves behind, and every
    later build of that op then waits for it forever (a hung CI run). The
    kernel drops our ``flock`` when its holder dies, so whoever holds it knows
    any torch lock file it finds is stale, and removes it.
    """
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(ext, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "zfunc-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            print(f"zfunc: removing {stale}, left by a build that did not finish", file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        try:
            yield build_dir
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _announce_build(name: str, ext: str) -> None:
    """One line on stderr before a real compile (not a cached load): it takes a while."""
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(ext, verbose=False))
    if not any(build_dir.glob(f"{ext}*.so")):
        print(f"zfunc: building native op {name!r}, once (about a minute; cached in {build_dir.parent})",
              file=sys.stderr, flush=True)


def report() -> list[dict]:
    """One row per op ever asked for: name, built, reason, flags (and cuda, module)."""
    with _lock:
        return [dict(r) for r in _results.values()]


def forget(name: str | None = None) -> None:
    """Drop this process's record of op ``name`` (of every op when None), so the next
    ``load`` checks and builds again: after installing a compiler or headers, and in
    tests that build an op under other settings."""
    with _lock:
        for d in (_results, _modules):
            if name is None:
                d.clear()
            else:
                d.pop(name, None)
