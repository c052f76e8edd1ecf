"""The simulated NeuronCore: `neuron` device registration, device tensors, HBM, cost model, timeline."""
from .backend import allow_loading, register, use_foreach_optimizers

register()  # first: everything below names torch.device("neuron")

from .runtime import DEVICE, Device  # noqa: E402
from .spec import PRESETS, TRN2, TRN3, DeviceSpec, preset  # noqa: E402
from .tensor import NEURON, NeuronTensor, _rebuild, wrap  # noqa: E402

allow_loading(_rebuild, NeuronTensor)
use_foreach_optimizers(NeuronTensor)

__all__ = ["DEVICE", "Device", "DeviceSpec", "NEURON", "NeuronTensor", "PRESETS", "TRN2", "TRN3",
           "preset", "wrap"]
