"""flodl_worker.device: the device a rank picks (CUDA faked: there is no GPU here) and
batches moved onto it."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from flodl_worker.device import DeviceError, choose_device, to_device


def gpus(n: int) -> dict:
    return {"cuda_available": lambda: n > 0, "device_count": lambda: n}


def test_auto_is_cuda_local_rank_when_cuda_is_visible_else_the_cpu():
    assert choose_device("auto", 1, **gpus(4)) == torch.device("cuda", 1)
    assert choose_device(None, 5, **gpus(4)) == torch.device("cuda", 1)  # more ranks than GPUs: wraps
    assert choose_device("auto", 3, **gpus(0)) == torch.device("cpu")
    assert choose_device("AUTO", 0, **gpus(0)) == torch.device("cpu")


def test_explicit_devices_and_their_errors():
    assert choose_device("cpu", 2, **gpus(4)) == torch.device("cpu")
    assert choose_device("cuda", 2, **gpus(4)) == torch.device("cuda", 2)
    assert choose_device(torch.device("cuda", 0), 2, **gpus(1)) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="CUDA is not available here"):
        choose_device("cuda:0", 0, **gpus(0))
    with pytest.raises(DeviceError, match="1 visible GPU"):
        choose_device("cuda:3", 0, **gpus(1))
    with pytest.raises(DeviceError, match="is not a device"):
        choose_device("tpu-ish", 0, **gpus(0))


def test_to_device_moves_nested_batches_and_leaves_tensors_already_there():
    Pair = namedtuple("Pair", "x y")
    x = torch.ones(2, 3)
    batch = {"a": [x, (x, 3)], "p": Pair(x, "label")}
    out = to_device(batch, torch.device("cpu"))
    assert out["a"][0] is x and out["a"][1][0] is x and out["a"][1][1] == 3
    assert isinstance(out["p"], Pair) and out["p"].x is x and out["p"].y == "label"
    assert to_device(torch.ones(1, dtype=torch.float64), torch.device("meta")).device.type == "meta"
