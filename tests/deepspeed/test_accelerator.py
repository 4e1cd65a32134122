"""``zfunc.deepspeed.accelerator.get_accelerator()`` answers as DeepSpeed's accelerator does on
this machine's device, and names what it does not offer."""
import pytest
import torch

from zfunc.deepspeed.accelerator import get_accelerator


def test_the_accelerator_is_torchs_device_under_deepspeeds_names():
    acc = get_accelerator()
    assert acc is get_accelerator()
    cuda = torch.cuda.is_available()
    assert acc.device_name() == ("cuda" if cuda else "cpu")
    assert acc.device_name(0) == ("cuda:0" if cuda else "cpu")
    assert acc.communication_backend_name() == ("nccl" if cuda else "gloo")
    x = torch.ones(2, device=acc.device_name(0))
    assert acc.on_accelerator(x) and x.device.type == acc.device(0).type
    assert torch.float32 in acc.supported_dtypes()
    assert acc.total_memory() >= acc.available_memory() > 0
    acc.manual_seed(3)
    a = torch.rand(3, device=acc.device_name())
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(3, device=acc.device_name()))
    acc.synchronize()
    acc.empty_cache()


def test_a_method_it_does_not_offer_is_named():
    with pytest.raises(AttributeError, match="create_op_builder.*not offered by zfunc.deepspeed"):
        get_accelerator().create_op_builder("FusedAdamBuilder")


def test_scripts_reach_it_as_deepspeed_accelerator():
    import zfunc.deepspeed as deepspeed

    assert deepspeed.accelerator.get_accelerator() is get_accelerator()
