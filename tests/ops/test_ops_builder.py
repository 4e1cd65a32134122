"""zfunc.ops.builder: flag choice, up-front checks, fallback reasons, the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from zfunc.ops import builder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fresh(monkeypatch):
    """Forget the per-process record of the test ops before and after each test."""
    names = []

    def name(n):
        names.append(n)
        builder.forget(n)
        return n

    monkeypatch.delenv("ZFUNC_OPS_DISABLE", raising=False)
    yield name
    for n in names:
        builder.forget(n)


def _row(name):
    return next(r for r in builder.report() if r["name"] == name)


def test_isa_flags_follow_cpuinfo(monkeypatch):
    monkeypatch.delenv("ZFUNC_OPS_ISA", raising=False)
    avx512 = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16".split())
    flags = builder.isa_cflags(avx512)
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"} <= set(flags)
    assert "-mavx512bf16" not in builder.isa_cflags(avx512 - {"avx512_bf16"})
    # AVX-512 without BW/VL (first Xeon Phi) is treated as AVX2
    assert builder.isa_cflags(avx512 - {"avx512bw"}) == ["-mavx2", "-mfma", "-mf16c"]
    assert builder.isa_cflags(frozenset({"avx2", "fma"})) == ["-mavx2", "-mfma"]
    assert builder.isa_cflags(frozenset({"sse4_2"})) == []
    assert builder.isa_cflags(frozenset()) == []
    monkeypatch.setenv("ZFUNC_OPS_ISA", "avx2")
    assert builder.isa_cflags(avx512) == ["-mavx2", "-mfma", "-mf16c"]
    monkeypatch.setenv("ZFUNC_OPS_ISA", "none")
    assert builder.isa_cflags(avx512) == []
    monkeypatch.setenv("ZFUNC_OPS_ISA", "sse9")
    with pytest.raises(ValueError, match="ZFUNC_OPS_ISA"):
        builder.isa_cflags(avx512)


def test_this_cpu_is_read():
    flags = builder.cpu_flags()
    if os.path.exists("/proc/cpuinfo") and "avx512f" in flags and "avx512bw" in flags \
            and "avx512vl" in flags:
        assert "-mavx512f" in builder.isa_cflags()


@pytest.mark.parametrize("value, disabled", [
    ("", False), ("0", False), ("1", True), ("all", True), ("cpu_adam", True),
    ("aio, cpu_adam", True), ("aio", False), ("CPU_ADAM", True),
])
def test_disable_env(monkeypatch, value, disabled):
    monkeypatch.setenv("ZFUNC_OPS_DISABLE", value)
    assert builder._disabled("cpu_adam") is disabled


def test_disabled_op_returns_none_quietly(fresh, monkeypatch):
    name = fresh("zz_disabled")
    monkeypatch.setenv("ZFUNC_OPS_DISABLE", "zz_disabled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert builder.load(name, ["adam/cpu_adam.cpp"]) is None
    row = _row(name)
    assert row["built"] is False and "ZFUNC_OPS_DISABLE" in row["reason"]
    assert set(row) >= {"name", "built", "reason", "flags"}


def test_missing_compiler_is_named_once(fresh, monkeypatch):
    name = fresh("zz_nocxx")
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.warns(builder.OpBuildWarning, match="/nonexistent/g\\+\\+"):
        assert builder.load(name, ["adam/cpu_adam.cpp"]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached: asking again says nothing more
        assert builder.load(name, ["adam/cpu_adam.cpp"]) is None
    assert "compiler '/nonexistent/g++' not found" in _row(name)["reason"]
    assert [r["name"] for r in builder.report()].count(name) == 1


def test_missing_ninja_is_named(fresh, monkeypatch):
    from torch.utils import cpp_extension

    name = fresh("zz_noninja")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.warns(builder.OpBuildWarning, match="ninja"):
        assert builder.load(name, ["adam/cpu_adam.cpp"]) is None
    assert _row(name)["reason"].startswith("ninja not found")


def test_missing_header_and_library_are_named(fresh):
    name = fresh("zz_nohdr")
    with pytest.warns(builder.OpBuildWarning):
        assert builder.load(name, ["adam/cpu_adam.cpp"],
                            required_headers=["zfunc_no_such_header.h"]) is None
    assert "header 'zfunc_no_such_header.h' not found" in _row(name)["reason"]
    name = fresh("zz_nolib")
    with pytest.warns(builder.OpBuildWarning):
        assert builder.load(name, ["adam/cpu_adam.cpp"],
                            required_libs=["zfunc_no_such_lib"]) is None
    assert "library 'zfunc_no_such_lib' not found" in _row(name)["reason"]


def test_present_header_and_library_pass_the_check(fresh):
    assert builder._probe(builder._cxx(), "#include <math.h>\nint main() { return 0; }\n",
                          ("-fsyntax-only",)) is None
    assert builder._probe(builder._cxx(), "int main() { return 0; }\n", ("-lm",)) is None


def test_missing_source_is_named(fresh):
    name = fresh("zz_nosrc")
    with pytest.warns(builder.OpBuildWarning, match="no_such.cpp"):
        assert builder.load(name, ["adam/no_such.cpp"]) is None


def test_compile_error_is_reported_not_raised(fresh, tmp_path, monkeypatch):
    name = fresh("zz_broken")
    src = tmp_path / "broken.cpp"
    src.write_text("int f() { return undefined_name; }\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.warns(builder.OpBuildWarning):
        assert builder.load(name, [str(src)]) is None  # absolute paths are allowed
    reason = _row(name)["reason"]
    assert reason.startswith("build failed") and "undefined_name" in reason


def test_cuda_op_without_cuda_says_why(fresh):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    name = fresh("zz_cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # expected on a CPU machine: recorded, not announced
        assert builder.load(name, ["adam/cuda_adam.cu"], cuda=True) is None
    assert "CUDA" in _row(name)["reason"]


def test_module_name_hashes_the_flags():
    a = builder._ext_name("x", ["-O3"], [], False)
    assert a == builder._ext_name("x", ["-O3"], [], False)
    assert a != builder._ext_name("x", ["-O3", "-mavx2"], [], False)
    assert a != builder._ext_name("x", ["-O3"], ["-laio"], False)
    assert a != builder._ext_name("x", ["-O3"], [], True)
    assert a.startswith("zfunc_x_")


@pytest.mark.slow
def test_cli_prints_a_table():
    env = dict(os.environ, ZFUNC_OPS_DISABLE="aio_uring,aio_libaio,aio_threads")
    out = subprocess.run([sys.executable, "-m", "zfunc.ops", "--json"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    names = {r["name"]: r for r in data["ops"]}
    assert {"cpu_adam", "cuda_adam"} <= set(names)
    assert names["cpu_adam"]["built"] is not builder._disabled("cpu_adam")
    out = subprocess.run([sys.executable, "-m", "zfunc.ops"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "| op" in out.stdout and "cpu_adam" in out.stdout


_CONCURRENT_BUILD = """
import json, sys, time
import torch
from zfunc.ops import builder
start = float(sys.argv[1])
time.sleep(max(0.0, start - time.time()))  # every process asks at the same moment
module = builder.load("bench_stream_copy", ["bench/stream_copy.cpp"])
src = torch.arange(100_000, dtype=torch.float32)
dst = torch.empty_like(src)
module.stream_copy(dst, src)
print(json.dumps({"file": module.__file__, "ok": bool(torch.equal(dst, src))}))
"""


@pytest.mark.slow
def test_processes_building_at_once_share_one_build(tmp_path):
    """Ranks started together by torchrun each call load(): one compiles, the rest wait."""
    import time

    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop("ZFUNC_OPS_DISABLE", None)
    start = str(time.time() + 3.0)
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT_BUILD, start], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["ok"] for r in results)
    assert len({r["file"] for r in results}) == 1  # one shared object, not three builds
    assert len(list((tmp_path / "ext").rglob("*.so"))) == 1


@pytest.mark.slow
def test_a_build_killed_midway_does_not_hang_the_next(tmp_path):
    """torch's build lock is a plain file: a build killed while compiling leaves it behind
    and every later build of the op would wait for it forever. The next build removes it.
    A real build says so on stderr first (a compile takes a while on a fresh machine); a load
    from the cache says nothing."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop("ZFUNC_OPS_DISABLE", None)
    run = lambda: subprocess.run([sys.executable, "-c", _CONCURRENT_BUILD, "0"], env=env, cwd=ROOT,  # noqa: E731
                                 capture_output=True, text=True, timeout=300)
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    assert "zfunc: building native op 'bench_stream_copy', once" in first.stderr
    cached = run()
    assert cached.returncode == 0 and "building native op" not in cached.stderr, cached.stderr[-2000:]
    [so] = list((tmp_path / "ext").rglob("*.so"))
    so.unlink()  # what a killed build leaves: no shared object, and torch's lock file
    (so.parent / "lock").touch()
    second = run()
    assert second.returncode == 0, second.stderr[-2000:]
    assert "left by a build that did not finish" in second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1])["ok"]


_BUILD_FROM = """
import json, sys
from pathlib import Path
import torch
from zfunc.ops import builder
builder.CSRC = Path(sys.argv[1])  # this copy of the sources
module = builder.load("bench_stream_copy", ["bench/stream_copy.cpp"])
src = torch.arange(1000, dtype=torch.float32)
dst = torch.empty_like(src)
module.stream_copy(dst, src)
print(json.dumps({"file": module.__file__, "ok": bool(torch.equal(dst, src))}))
"""


@pytest.mark.slow
def test_copies_of_the_sources_share_one_build_and_a_change_builds_anew(tmp_path):
    """Two copies of csrc/ (two clones, or a clone and an installed copy) used by processes in turn
    share one build: no process after the first compiles or links anything (every object and shared
    object keeps its time). A changed source builds anew, beside the first build, which stays."""
    import shutil

    copies = [tmp_path / "a", tmp_path / "b"]
    for c in copies:
        shutil.copytree(builder.CSRC, c)
    ext = tmp_path / "ext"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext))
    env.pop("ZFUNC_OPS_DISABLE", None)

    def run(copy):
        r = subprocess.run([sys.executable, "-c", _BUILD_FROM, str(copy)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["ok"]
        return out["file"], "building native op" in r.stderr

    def built():
        return {p: p.stat().st_mtime_ns for p in ext.rglob("*") if p.suffix in (".so", ".o")}

    first, compiled = run(copies[0])
    assert compiled
    after_first = built()
    for copy in (copies[1], copies[0], copies[1]):
        assert run(copy) == (first, False)
        assert built() == after_first, "a copy of the same sources rebuilt"
    source = copies[1] / "bench" / "stream_copy.cpp"
    source.write_text(source.read_text() + "\n// changed\n")
    changed, compiled = run(copies[1])
    assert compiled and changed != first
    assert run(copies[0]) == (first, False)
    assert {p: t for p, t in built().items() if p in after_first} == after_first


def test_the_build_key_is_the_sources_not_their_place(tmp_path, monkeypatch):
    """The digest that names a build follows the sources' and headers' contents, not their folder."""
    import shutil

    for c in ("a", "b"):
        shutil.copytree(builder.CSRC, tmp_path / c)
    digests = []
    for c in ("a", "b"):
        monkeypatch.setattr(builder, "CSRC", tmp_path / c)
        digests.append(builder._build_files(["adam/cpu_adam.cpp"])[2])
    assert digests[0] == digests[1]
    (tmp_path / "b" / "adam" / "cpu_simd.h").write_text("// a changed header\n")
    assert builder._build_files(["adam/cpu_adam.cpp"])[2] != digests[0]
    files, compiled, _ = builder._build_files(["adam/cpu_adam.cpp"])
    assert compiled == ["adam/cpu_adam.cpp"] and "adam/cpu_simd.h" in files and "aio/aio.h" in files
