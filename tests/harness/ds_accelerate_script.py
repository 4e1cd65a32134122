"""A small Accelerate training script as users write it for ``accelerate launch --config_file``:
``Accelerator()`` takes DeepSpeed from the launcher's environment (the config file's
``distributed_type: DEEPSPEED`` and ``deepspeed_config_file``), ``prepare``, ``accumulate``,
``backward``, ``optimizer.step()``; gloo through ``InitProcessGroupKwargs`` (on CPUs). Each rank
writes its losses and the module of the engine it got to ``OUT.<rank>`` (json).

    accelerate launch --config_file acc.yaml ds_accelerate_script.py OUT
"""
import json
import sys

import torch
from torch import nn
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs


def main():
    out = sys.argv[1]
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    with open(f"{out}.{accelerator.process_index}", "w") as f:
        json.dump({"losses": losses, "engine": type(model).__module__}, f)


if __name__ == "__main__":
    main()
