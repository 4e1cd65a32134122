"""A launch of more than one node: two torchrun agents on this machine, joined by c10d rendezvous on
127.0.0.1 as two nodes of a cluster would be, train the same steps as one process on the global batch.

Run by the tests below; run as a script (``python -m torch.distributed.run ... test_two_nodes.py OUT
LAYOUT``) it is the training each rank does: ZeRO-3 AdamW on its slice of each global batch, then the
gathered weights to ``OUT`` (rank 0). ``LAYOUT``: ``flat`` (one group of every rank) or ``mesh``
(``zf.dist.mesh()``: shard within a node, replicate across nodes, where zfunc has it).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "..", "harness")
EXAMPLES = os.path.join(HERE, "..", "..", "examples")
MODEL, STEPS, PER_RANK = "gpt", 3, 2


def _train(out: str, layout: str) -> None:
    sys.path.insert(0, HARNESS)
    import zfunc as zf
    from cases import _setup, compose
    from models import batch, local

    torch.set_num_threads(1)
    zf.dist.init()
    rank, world, model, shape_model, loss_fn = _setup(MODEL, {}, 0)
    if layout == "mesh":
        mesh = zf.dist.mesh()
        assert tuple(mesh.mesh.shape) == (int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
                                          int(os.environ["LOCAL_WORLD_SIZE"])), mesh
        step = zf.zero3(compose(None, loss_fn), mesh=mesh)
    else:
        step = compose(3, loss_fn)
    state = step.init(model)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, local(batch(MODEL, shape_model, i, PER_RANK * world), rank, world))
        losses.append(metrics["loss"].item())
    params = zf.gather_params(state)
    if rank == 0:
        torch.save({"params": params, "losses": losses, "world": world, "comm": metrics["comm"]}, out)
    zf.dist.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_agents(script_and_args: list[str], per_node: int, timeout: int = 420) -> list[str]:
    """Two torchrun agents (``--nnodes 2``, ``per_node`` ranks each), started together as two
    nodes' agents are, meeting at a c10d rendezvous on 127.0.0.1. Their outputs (stdout+stderr)."""
    port, run_id = _free_port(), f"zfunc-two-nodes-{os.getpid()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p))
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
         "--node-rank", str(node), "--max-restarts", "0", *script_and_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-4000:]
    return outputs


def _single_process_reference(world: int) -> dict:
    sys.path.insert(0, HARNESS)
    from cases import reference

    return reference(MODEL, {}, steps=STEPS, batch_size=PER_RANK * world)


@pytest.mark.slow
@pytest.mark.parametrize("layout,per_node", [("flat", 1), ("mesh", 2)])
def test_two_agents_train_as_one_process(tmp_path, layout, per_node):
    """torchrun's two agents rendezvous over c10d as two nodes: ZeRO-3 over both nodes' ranks (flat,
    2 x 1), or under the mesh ``zf.dist.mesh()`` builds from torchrun's environment (2 x 2: each
    node's two ranks one shard group, the two nodes replicas), equals plain PyTorch AdamW on the
    global batch in one process (fp32, 1e-5), and the losses the same."""
    out = str(tmp_path / "rank0.pt")
    _two_agents([os.path.abspath(__file__), out, layout], per_node=per_node)
    got = torch.load(out)
    want = _single_process_reference(2 * per_node)
    assert got["world"] == 2 * per_node
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    # the last step's collectives are those zf.estimate predicts for this layout (gloo's), by mesh dim
    sys.path.insert(0, HARNESS)
    import zfunc as zf
    from models import build
    from zfunc.estimator import Cluster, Composition, Link

    cluster = Cluster(2, per_node, Link(1e9), Link(1e9), backend="gloo")
    predicted = zf.estimate(build(MODEL), Composition(stage=3, hybrid=layout == "mesh"), cluster).comm
    data = {label: {k: v for k, v in kinds.items() if k not in ("agreement", "barrier")}
            for label, kinds in got["comm"].items()}
    assert {label: kinds for label, kinds in data.items() if kinds} == predicted
    if layout == "mesh":  # nothing gathered across nodes: one all-reduce of each gradient shard a step
        assert set(predicted["replicate"]) == {"all_reduce"} and "all_gather" in predicted["shard"]


@pytest.mark.slow
def test_two_agents_train_the_example(tmp_path):
    """The README's example (examples/train_gpt.py, ZeRO-3) launched as two nodes of one rank each
    trains to the same validation losses as one agent of two ranks (``--standalone``): the launch, not
    the layout, is all that differs, so the printed losses are equal to the digit."""
    args = [os.path.join(EXAMPLES, "train_gpt.py"), "--steps", "3", "--layers", "2", "--width", "32", "--heads",
            "2", "--seq", "32", "--batch", "4", "--mb", "0.05", "--eval-batches", "2", "--sample", "8"]
    two_nodes = "".join(_two_agents(args, per_node=1))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *args], capture_output=True, text=True, timeout=420, env=env)
    assert one.returncode == 0, one.stderr[-4000:]
    line = [ln for ln in (one.stdout + one.stderr).splitlines() if ln.startswith("val loss")]
    assert len(line) == 1, one.stdout[-2000:]
    assert line[0] in two_nodes, (line[0], two_nodes[-2000:])
    assert "on 2 rank(s)" in two_nodes


if __name__ == "__main__":
    _train(sys.argv[1], sys.argv[2])
