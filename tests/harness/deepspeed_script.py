"""The DeepSpeed-style training script's model, data set and config: the script runs under real
DeepSpeed and under ``zfunc.deepspeed`` (tests/deepspeed/test_script_against_deepspeed.py), and the
tests of ``zfunc.deepspeed.initialize`` and the engine's methods use the same three."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def dataset(n: int = 48):
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g))


def ds_config(stage: int, gas: int, world: int) -> dict:
    return {
        "train_batch_size": 4 * gas * world,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.8, 0.99], "weight_decay": 0.01,
                                                   "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 3, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }
