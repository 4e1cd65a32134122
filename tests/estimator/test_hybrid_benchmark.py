"""benchmarks/hybrid.py runs (W = 4, fresh processes, --small), and what it reports can be trusted:
its collective-counting shim, which measures the peers' bytes per mesh dim, counts zfunc's own
collectives exactly as zfunc's metrics["comm"] does, and flat and hybrid zfunc reach the same loss."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "hybrid.py")


@pytest.mark.slow
def test_the_shim_counts_what_zfunc_counts(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, SCRIPT, "--small", "--peers", "zfunc,zfunc-hybrid", "--json", str(out)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for peer in ("zfunc", "zfunc-hybrid"):
        own, shim = rows[peer]["zfunc_comm"], rows[peer]["shim_comm"]
        assert own, peer
        for dim, kinds in own.items():
            for kind, counted in kinds.items():
                seen = shim[dim][kind]
                if dim == "world" and kind == "all_reduce":  # the shim also sees the step's agreement: one small call
                    assert seen["calls"] == counted["calls"] + 1, (peer, shim, own)
                    assert 0 < seen["bytes"] - counted["bytes"] < 1024, (peer, shim, own)
                else:
                    assert seen == counted, (peer, dim, kind, shim, own)
    assert set(rows["zfunc-hybrid"]["zfunc_comm"]) == {"shard", "replicate"}
    flat, hybrid = rows["zfunc"]["final_loss"], rows["zfunc-hybrid"]["final_loss"]
    assert abs(flat - hybrid) <= 1e-5 * abs(flat)
    assert "| zfunc zero3(mesh=zf.dist.mesh(shard=2)), 2 x 2 |" in run.stdout
