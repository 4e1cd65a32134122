"""``deepspeed.zero.register_external_parameter``: a weight read outside its own module (as
transformers' speech models mark theirs) trains under ZeRO-3 as in plain PyTorch; the call is
checked as DeepSpeed checks it."""
import copy

import pytest
import torch
from torch import nn

import zfunc.deepspeed as deepspeed


class ReadsAnothersWeight(nn.Module):
    """DeepSpeed's own example: ``layer2``'s forward reads ``layer1.weight``."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(6, 6)
        self.layer2 = nn.Linear(6, 6)
        deepspeed.zero.register_external_parameter(self.layer2, self.layer1.weight)

    def forward(self, x):
        return self.layer2(torch.tanh(self.layer1(x))) + x @ self.layer1.weight.t()


def test_a_registered_external_weight_trains_as_plain_pytorch():
    torch.manual_seed(0)
    model = ReadsAnothersWeight()
    plain = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}})
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for i in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        want = plain(x).pow(2).mean()
        want.backward()
        nn.utils.clip_grad_norm_(plain.parameters(), 1.0)  # the shared weight's gradient counted once
        reference.step()
        reference.zero_grad()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    deepspeed.zero.unregister_external_parameter(model.layer2, model.layer1.weight)


def test_a_tensor_that_is_no_parameter_is_refused_as_deepspeed_refuses_it():
    with pytest.raises(RuntimeError, match="nn.Parameter"):
        deepspeed.zero.register_external_parameter(nn.Linear(2, 2), torch.zeros(2))
    from zfunc.deepspeed.runtime.zero.partition_parameters import register_external_parameter
    assert register_external_parameter is deepspeed.zero.register_external_parameter
