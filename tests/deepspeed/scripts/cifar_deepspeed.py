"""A DeepSpeed training script as DeepSpeed's own CIFAR-10 example (DeepSpeedExamples,
training/cifar) lays it out, run offline on CIFAR-shaped synthetic images.

It is written against real DeepSpeed and runs unchanged under it; the tests run it a second
time with its one ``import deepspeed`` line changed to ``import zfunc.deepspeed as deepspeed``
and compare what it prints. Its parts are the example's: ``add_config_arguments``,
``init_distributed``, the config as a dict with ``optimizer``, ``scheduler``, clipping and
``zero_optimization``, ``initialize`` with ``model_parameters`` and ``training_data`` (the
engine's own data loader), the ``engine(x)`` / ``backward`` / ``step`` loop with the device and
dtype read from the engine, and an evaluation under ``torch.no_grad()``.

    torchrun --nproc_per_node 2 cifar_deepspeed.py --stage 3
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--log_interval", type=int, default=1)
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--samples", type=int, default=96, help="synthetic training images")
    parser.add_argument("--batch", type=int, default=8, help="train_batch_size (all ranks, all micro-batches)")
    parser.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    """The tutorial's small convolutional network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def ds_config(args) -> dict:
    return {
        "train_batch_size": args.batch,
        "gradient_accumulation_steps": args.gas,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                  "weight_decay": 3e-7, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": False, "contiguous_gradients": True},
    }


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = synthetic_cifar(args.samples, seed=1)
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config(args))
    local_device = model_engine.device
    local_rank = model_engine.local_rank
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else None
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1}, {i + 1}] loss: {running_loss / args.log_interval:.6f} "
                      f"lr: {optimizer.param_groups[0]['lr']:.6e}", flush=True)
                running_loss = 0.0

    testset = synthetic_cifar(32, seed=2)
    correct = total = 0
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(testset, batch_size=8):
            images = images.to(local_device)
            if target_dtype is not None:
                images = images.to(target_dtype)
            predicted = model_engine(images).argmax(1)
            total += labels.size(0)
            correct += (predicted.cpu() == labels).sum().item()
    if local_rank == 0:
        print(f"accuracy of the network on the {total} test images: {100 * correct / total:.2f} %", flush=True)
        print(f"steps {model_engine.global_steps} samples {model_engine.global_samples}", flush=True)


if __name__ == "__main__":
    main()
