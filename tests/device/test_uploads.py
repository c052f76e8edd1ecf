"""Moving data to the device copies it, in every mode and grad mode: a device tensor never shares
memory with the CPU tensor it was made from (a device write must not change the user's data)."""
import copy

import pytest
import torch

import tilewise

MODES = ["eager", "adaptive", "compiled"]


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad", "grad"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["to", "to_device_dtype", "slice_to", "to_other"])
def test_an_upload_copies_the_cpu_tensor(mode, grad_mode, how):
    data = torch.arange(12.0).reshape(4, 3)
    before = data.clone()
    block = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[grad_mode]
    with tilewise.engine(mode=mode), block():
        if how == "to":
            z = data.to("neuron")
        elif how == "to_device_dtype":
            z = data.to(torch.device("neuron"), torch.float32)
        elif how == "slice_to":
            z = data[1:3].to("neuron")
        else:
            z = data.to(torch.empty(1, device="neuron"))
        z.add_(100)
        got = z.cpu()
    assert torch.equal(data, before), "a device write changed the CPU tensor"
    expected = (before[1:3] if how == "slice_to" else before) + 100
    assert torch.equal(got, expected)
    assert z.storage_offset() == 0


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_a_validation_loop_with_a_short_last_batch_compiles_one_region_per_batch_size(mode):
    """Batches are slices of one CPU tensor (a DataLoader over a tensor); under inference_mode each
    upload is a fresh device tensor, so the same batch size is the same region wherever its slice
    starts: two batch sizes, two compiles, and every later batch hits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(inplace=True), torch.nn.Dropout(0.2), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    device_model = copy.deepcopy(model).to("neuron")
    data = torch.randn(70, 3, 8, 8)
    batches = [data[i:i + 16] for i in range(0, 70, 16)]  # 16, 16, 16, 16, 6
    tilewise.reset_caches()
    tilewise.stats().reset()
    warmup_compiles = None
    with tilewise.engine(mode=mode), torch.inference_mode():
        for epoch in range(4):
            if epoch == 3:  # adaptive: the short batch is stable at its third epoch
                warmup_compiles = tilewise.stats().compiles
                tilewise.stats().reset()
            for x in batches:
                torch.testing.assert_close(device_model(x.to("neuron")).cpu(), model(x), rtol=1e-4, atol=1e-5)
    stats = tilewise.stats()
    assert warmup_compiles == 2
    assert stats.compiled_fraction == 1.0, stats.report()
    assert stats.compiles == 0 and stats.cache_hits == len(batches), stats.report()
