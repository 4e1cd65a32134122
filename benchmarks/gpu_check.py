"""The GPU checklist in one go: which native ops built, the CUDA tests, the suite on this
machine's torch, and the GPU benchmarks against their peers; a short table last.

    python benchmarks/gpu_check.py --out DIR                  # every section
    python benchmarks/gpu_check.py --out DIR --only ops,cuda-tests

Each section runs as a subprocess with its own time limit; its whole output goes to
``DIR/<section>.log``, each failing test's traceback to ``DIR/<section>.failures`` and every
test's outcome to ``DIR/<section>.failures.outcomes`` as they happen, and the table to
``DIR/summary.md``. A section passes when its command exits 0. On a machine without CUDA
the CUDA sections say so and fail.

Building the native ops there takes about 100 s (nvcc). ``--builds FILE`` saves zfunc's
builds and DeepSpeed's CPU Adam to ``DIR/builds.tgz`` at the end and, where FILE exists,
unpacks it first, dating ``csrc/`` back to 2000 so ninja finds its objects newer than the
sources it was sent: a later call on a fresh machine skips the builds.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CUDA_TESTS = ["tests/core/test_gpu.py", "tests/transforms/offload/test_cpu_offload.py", "tests/transforms/offload/test_nvme_offload.py", "tests/optim/test_optim.py",
              "tests/core/test_errors.py", "tests/ops/test_ops_builder.py", "tests/ops/test_cuda_adam.py"]

SECTIONS = {
    "env": ([PY, "-c", "import sys, torch; print(sys.version); print('torch', torch.__version__, torch.version.cuda);"
             "print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"], 60),
    "ops": ([PY, "-m", "zfunc.ops", "--verbose"], 400),
    "cuda-tests": ([PY, "-m", "pytest", "-q", "-rfs", "--tb=short", "-p", "no:cacheprovider", "-n", "8", *CUDA_TESTS],
                   420),
    "adam": ([PY, "benchmarks/cuda_adam.py", "--sizes", "50M,200M"], 240),
    "gpt-fits": ([PY, "benchmarks/gpu_gpt.py", "fits", "--warmup", "2", "--steps", "4", "--timeout", "60"], 420),
    "gpt-offload": ([PY, "benchmarks/gpu_gpt.py", "offload", "--accumulate", "8", "--warmup", "1", "--steps", "2",
                     "--timeout", "75"], 540),
    # 4x the tokens a step: how far the fixed cost of the host update falls toward the 30%-of-peak aim
    "gpt-offload-long": ([PY, "benchmarks/gpu_gpt.py", "offload", "--accumulate", "32", "--warmup", "1", "--steps", "2",
                          "--timeout", "120"], 540),
    "gpt-nvme": ([PY, "benchmarks/gpu_gpt.py", "nvme"], 540),
    # the planned split of the update against a hand-set one and ZeRO-Offload, with each step's roofline
    "gpt-offload-plan": ([PY, "benchmarks/gpu_gpt.py", "offload", "--peers", "zfunc_cpu,zfunc_cpu_sync,zfunc_cpu_host_sums,zfunc_cpu_plan,zfunc_cpu_ratio,ds_cpu",
                          "--accumulate", "8", "--warmup", "1", "--steps", "2", "--timeout", "90"], 540),
    # issue 50: one large micro-batch a step, blocks recomputed, chunked loss: 16K and 64K tokens under the 20 GiB cap
    "gpt-large": ([PY, "benchmarks/gpu_gpt.py", "large", "--warmup", "1", "--steps", "2", "--timeout", "110"], 560),
    "gpt-large-64k": ([PY, "benchmarks/gpu_gpt.py", "large", "--batch", "32", "--steps", "2", "--timeout", "110",
                       "--peers", "zfunc_cpu_delay_recompute,zfunc_cpu_recompute,ds_cpu_recompute"], 400),
    # the largest Llama of 14B's dimensions the host holds, 64K tokens a step, delay=1 then exact
    "largest": (["bash", "-c", f"{PY} benchmarks/gpu_largest.py --steps 2 && {PY} benchmarks/gpu_largest.py --steps 2 "
                 "--update exact"], 580),
    # compiled blocks and zf.jit against plain PyTorch's compiled layers, FSDP2 and DeepSpeed (a 1.1B Llama)
    "compiled": ([PY, "benchmarks/compiled_peers.py", "--steps", "5", "--timeout", "150"], 540),
    "suite": ([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "--tb=short", "-n", "14", "tests"], 380),
}


def run(name: str, out: Path) -> tuple[str, float, str]:
    cmd, limit = SECTIONS[name]
    log = out / f"{name}.log"
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1", ZFUNC_FAILURE_LOG=str(out / f"{name}.failures"))
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {limit} s"
    took = time.monotonic() - start
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    status = "pass" if rc == 0 else f"FAIL ({rc})"
    print(f"== {name}: {status} in {took:.0f} s", flush=True)
    print("\n".join(log.read_text().strip().splitlines()[-25:]), flush=True)
    return status, took, tail[0][:100]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections, in order")
    ap.add_argument("--limits", default="", help="seconds per section, e.g. cuda-tests=170,gpt-fits=120")
    ap.add_argument("--builds", type=Path, default=None, help="a builds.tgz from an earlier call to unpack first")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = Path.home() / ".cache" / "torch_extensions"  # torch's default, one folder per Python and CUDA
    if args.builds is not None and args.builds.exists():
        for src in (ROOT / "csrc").rglob("*"):  # older than the objects, which ninja's log dates
            os.utime(src, (946684800, 946684800))
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-xzf", str(args.builds.resolve()), "-C", str(cache)], check=True)
    for item in filter(None, args.limits.split(",")):
        name, seconds = item.split("=")
        SECTIONS[name] = (SECTIONS[name][0], float(seconds))
    rows = [(name, *run(name, args.out)) for name in args.only.split(",")]
    table = ["| section | result | seconds | last line |", "| --- | --- | ---: | --- |"]
    table += [f"| {n} | {s} | {t:.0f} | {last.replace('|', '/')} |" for n, s, t, last in rows]
    (args.out / "summary.md").write_text("\n".join(table) + "\n")
    if args.builds is not None and cache.exists():  # zfunc's ops and DeepSpeed's CPU Adam: small enough to carry
        kept = [str(d.relative_to(cache)) for sub in cache.iterdir() if sub.is_dir() for d in sub.iterdir()
                if d.name.startswith(("zfunc_", "cpu_adam"))]
        subprocess.run(["tar", "-czf", str((args.out / "builds.tgz").resolve()), "--exclude=lock", "-C", str(cache),
                        *kept])
    print("\n".join(table))


if __name__ == "__main__":
    main()
