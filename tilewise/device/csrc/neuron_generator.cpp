// torch.Generator(device="neuron"): the generator PyTorch's PrivateUse1 hooks make for a neuron
// device. It is CPU's generator (Mersenne Twister and its cached normal samples, the same seed
// and state layout) reporting device neuron:<index>; random ops on neuron tensors run CPU's
// kernels with a CPU generator holding its state (tilewise/device/generators.py), so a neuron
// generator draws exactly what a CPU generator seeded alike draws.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <torch/library.h>

namespace {

struct NeuronGeneratorImpl : public at::CPUGeneratorImpl {
  explicit NeuronGeneratorImpl(c10::DeviceIndex index) {
    device_ = c10::Device(c10::DeviceType::PrivateUse1, index < 0 ? 0 : index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }

 private:
  NeuronGeneratorImpl* clone_impl() const override {
    auto* copy = new NeuronGeneratorImpl(device_.index());
    copy->set_state(*get_state());
    return copy;
  }
};

at::Generator make_neuron_generator(c10::DeviceIndex index) {
  return at::make_generator<NeuronGeneratorImpl>(index);
}

// Registered when Python calls it (once), not when the library loads: the loader keeps PyTorch's
// note that this registration is deprecated off the program's stderr.
void install() {
  static at::_GeneratorRegister registered(make_neuron_generator);
}

}  // namespace

TORCH_LIBRARY(tilewise_generator, m) {
  m.def("install() -> ()", &install);
}
