"""TorchTitan's Trainer and torchao on `neuron` against the CPU; needs the `titan` extra
(`pip install -e .[titan]`): skipped when torchtitan or torchao cannot be imported."""
