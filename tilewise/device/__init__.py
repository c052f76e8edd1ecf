"""The simulated NeuronCore: `neuron` device registration, device tensors, HBM, cost model, timeline."""
from .backend import (allow_loading, backward_on_calling_thread, convert_modules_in_place, fork_safely, register,
                      share_between_processes, treat_host_memory_as_pinned, use_foreach_optimizers)

register()  # first: everything below names torch.device("neuron")

from . import generators, serialization, unsupported  # noqa: E402
from .accelerator import answer_accelerator_api  # noqa: E402
from .parallel import data_parallel_across_cores  # noqa: E402
from .runtime import DEVICE, Device  # noqa: E402
from .spec import PRESETS, TRN1, TRN2, TRN3, DeviceSpec, preset  # noqa: E402
from .tensor import NEURON, NeuronTensor, _rebuild, reduce_for_process, wrap  # noqa: E402

allow_loading(_rebuild, NeuronTensor)
serialization.register(wrap)
use_foreach_optimizers(NeuronTensor)
convert_modules_in_place(NeuronTensor)
share_between_processes(NeuronTensor, reduce_for_process)
treat_host_memory_as_pinned(NEURON.type)
fork_safely(DEVICE)
backward_on_calling_thread()
answer_accelerator_api()
data_parallel_across_cores()
unsupported.refuse_storages()
unsupported.refuse_nested()
generators.install()

__all__ = ["DEVICE", "Device", "DeviceSpec", "NEURON", "NeuronTensor", "PRESETS", "TRN1", "TRN2", "TRN3",
           "preset", "wrap"]
