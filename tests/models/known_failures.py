"""Root causes of the model-suite cases that fail today, one constant each, with a minimal repro.

Tests carry them as strict xfail reasons: when a fix lands, the case turns XPASS and its mark goes.
"""

TENSOR_FACTORY_IN_ENGINE = (
    "device/eager factories: inside any TorchDispatchMode (every engine mode), torch.tensor(data, "
    "device='neuron') excludes the Python key and reaches aten.empty.memory_format on PrivateUse1 "
    "through the boxed Library.fallback, whose trampoline has no registration for the op: INTERNAL ASSERT "
    "python_dispatch.cpp:1054 'func != nullptr'. Repro: `with tilewise.engine(mode='eager'): "
    "torch.tensor([1.], device='neuron')`. generate() hits it in DynamicCache.lazy_initialization and "
    "_prepare_special_tokens; registering per-op PrivateUse1 kernels for empty.memory_format and "
    "empty_strided (as factories.py does for copy_) makes generate equal CPU in all three modes")

EVAL_BATCH_NORM_SAVE_MEAN = (
    "adaptive runtime _replay (eager replay of a recorded op): lazy outputs are allocated from the meta "
    "kernel, and aten.native_batch_norm with training=False returns save_mean/save_invstd of shape [0] on "
    "CPU but [C] from meta, so buffer.copy_(value) fails 'size of tensor a (8) must match ... b (0)'. "
    "Repro: `bn = nn.BatchNorm2d(8).eval().to('neuron'); with tilewise.engine(mode='adaptive'): "
    "bn(torch.randn(2, 8, 4, 4).to('neuron')).cpu()`")
