"""The simulated NeuronCore: `neuron` device registration, device tensors, HBM, cost model, timeline."""
from .backend import allow_loading, convert_modules_in_place, register, use_foreach_optimizers

register()  # first: everything below names torch.device("neuron")

from . import serialization  # noqa: E402
from .runtime import DEVICE, Device  # noqa: E402
from .spec import PRESETS, TRN2, TRN3, DeviceSpec, preset  # noqa: E402
from .tensor import NEURON, NeuronTensor, _rebuild, wrap  # noqa: E402

allow_loading(_rebuild, NeuronTensor)
serialization.register()
use_foreach_optimizers(NeuronTensor)
convert_modules_in_place(NeuronTensor)

__all__ = ["DEVICE", "Device", "DeviceSpec", "NEURON", "NeuronTensor", "PRESETS", "TRN2", "TRN3",
           "preset", "wrap"]
