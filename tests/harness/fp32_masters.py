"""Plain PyTorch's mixed precision, the oracle of zfunc's: a low-precision model computes the
gradients, an fp32 copy of it (the master) takes the update, and the low-precision weights are set
from the master after each step."""
import torch


def master_step(master, low, opt) -> None:
    """``opt`` (over ``master``'s parameters) steps on ``low``'s gradients, cast to fp32; ``low``'s
    parameters are then the master's, rounded to their dtype."""
    for mp, lp in zip(master.parameters(), low.parameters()):
        mp.grad = lp.grad.float()
    opt.step()
    with torch.no_grad():
        for mp, lp in zip(master.parameters(), low.parameters()):
            lp.copy_(mp)
