"""nn.TransformerEncoder's nested-tensor fast path (no gradients, a padding mask) gives CPU's values
on neuron, in every mode (eager/nested_fast_path.py); it failed inside PyTorch before."""
import copy

import pytest
import torch

import tilewise

MODES = ("eager", "adaptive", "compiled")


def _encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2).eval()  # enable_nested_tensor=True, the default


def _batch():
    torch.manual_seed(1)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True  # padding at the end of a sequence: what the fast path packs away
    mask[2, 4:] = True
    return torch.randn(3, 5, 16), mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_encoder_with_a_padding_mask_computes_cpu_s_values(no_grad, mode):
    encoder, (x, mask) = _encoder(), _batch()
    with no_grad():
        expected = encoder(x, src_key_padding_mask=mask)
    on_neuron = copy.deepcopy(encoder).to("neuron")
    with tilewise.engine(mode=mode), no_grad():
        # a pending input in the lazy modes: the encoder reads it computed
        src = x.to("neuron") * 1.0
        got = on_neuron(src, src_key_padding_mask=mask.to("neuron"))
        assert got.device.type == "neuron"
        got = got.cpu()
    assert torch.equal(got, expected)
    assert expected[1, 3:].eq(0).all()  # the fast path ran on the CPU: padded positions are zeros


def test_the_encoder_s_hooks_run_once_on_neuron_tensors():
    encoder, (x, mask) = _encoder(), _batch()
    on_neuron = encoder.to("neuron")
    seen = []
    on_neuron.register_forward_pre_hook(lambda module, args: seen.append(("pre", args[0].device.type)))
    on_neuron.register_forward_hook(lambda module, args, out: seen.append(("post", out.device.type)))
    with torch.no_grad():
        on_neuron(x.to("neuron"), src_key_padding_mask=mask.to("neuron"))
    assert seen == [("pre", "neuron"), ("post", "neuron")]


def test_a_transformer_with_padding_masks_computes_cpu_s_values():
    torch.manual_seed(0)
    model = torch.nn.Transformer(16, 4, 2, 2, 32, batch_first=True).eval()
    x, mask = _batch()
    target = torch.randn(3, 4, 16)
    with torch.no_grad():
        expected = model(x, target, src_key_padding_mask=mask, memory_key_padding_mask=mask)
        got = copy.deepcopy(model).to("neuron")(x.to("neuron"), target.to("neuron"),
                                                 src_key_padding_mask=mask.to("neuron"),
                                                 memory_key_padding_mask=mask.to("neuron")).cpu()
    assert torch.equal(got, expected)


def test_a_nested_neuron_tensor_asked_for_directly_is_refused_in_words():
    x, mask = _batch()
    with pytest.raises(tilewise.DeviceError, match="dense"):
        torch._nested_tensor_from_mask(x.to("neuron"), mask.logical_not().to("neuron"))
