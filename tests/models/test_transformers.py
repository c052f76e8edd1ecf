"""Hugging Face Transformers models trained and generating on `neuron` in every engine mode."""
import pytest
import torch

import tilewise

from .helpers import MODES, assert_compiled_if_lazy, assert_same_training, neuron_copy, train_on_cpu_and_neuron, \
    xfail_modes
from .hf_models import CASES, batch, build, step_loss
from .known_failures import TENSOR_FACTORY_IN_ENGINE

STEPS = 5  # the first step creates the AdamW state; adaptive mode compiles after 3 identical steps
NEW_TOKENS = 4


def _adamw(params):
    # Attention's key bias has a zero gradient in exact arithmetic (softmax ignores a shift shared
    # by a row); its computed gradient is rounding noise (~1e-11), which Adam would divide by its
    # own magnitude and turn into lr-sized steps in random directions: the larger eps keeps noise
    # from being amplified, so that two correct programs agree to float32 tolerance.
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


# The heaviest (8-17 s each on 2 cores) run only without -m "not slow"; GPT-2 in every mode and
# every model in eager mode stay in CI.
SLOW_TRAINING = {("t5", "adaptive"), ("t5", "compiled"), ("bert", "adaptive"), ("bert", "compiled"),
                 ("llama", "adaptive")}


@pytest.mark.parametrize("name,mode", [
    pytest.param(name, mode, marks=[pytest.mark.slow] if (name, mode) in SLOW_TRAINING else [])
    for name in sorted(CASES) for mode in MODES])
def test_training_matches_cpu(name, mode):
    model = build(name)
    run, reference = train_on_cpu_and_neuron(model, step_loss(name), _adamw, mode, STEPS)
    assert_same_training(run, reference)
    assert_compiled_if_lazy(mode)


# With that failure worked around locally (PrivateUse1 kernels for empty.memory_format/empty_strided),
# eager and adaptive match CPU; compiled mode then has 1/4096 elements of h.1.mlp.c_proj.weight off by
# 2.0e-5 (rel 1.8e-2) after 5 AdamW steps: not yet diagnosed, so compiled stays expected to fail.
CACHE_ON_COMPILED = TENSOR_FACTORY_IN_ENGINE + "; then, in compiled mode, an undiagnosed 2e-5 weight difference"


@pytest.mark.parametrize("mode", xfail_modes({"eager": TENSOR_FACTORY_IN_ENGINE, "adaptive": TENSOR_FACTORY_IN_ENGINE,
                                              "compiled": CACHE_ON_COMPILED}))
def test_gpt2_training_with_the_default_cache_setting_matches_cpu(mode):
    """As a user writes it: the config's use_cache=True makes the forward build a DynamicCache."""
    ids, _ = batch()

    def loss(model):
        return model(input_ids=ids.to(model.device), labels=ids.to(model.device)).loss
    run, reference = train_on_cpu_and_neuron(build("gpt2"), loss, _adamw, mode, STEPS)
    assert_same_training(run, reference)
    assert_compiled_if_lazy(mode)


def _generate(model, ids):
    model.eval()
    with torch.no_grad():
        return model.generate(input_ids=ids.to(model.device), attention_mask=torch.ones_like(ids).to(model.device),
                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).cpu()


@pytest.mark.parametrize("mode", xfail_modes(dict.fromkeys(MODES, TENSOR_FACTORY_IN_ENGINE)))
@pytest.mark.parametrize("name", sorted(n for n in CASES if n != "bert"))
def test_greedy_generate_matches_cpu(name, mode):
    model = build(name)
    ids, _ = batch()
    neuron_model = neuron_copy(model)
    expected = _generate(model, ids)
    with tilewise.engine(mode=mode):
        tokens = _generate(neuron_model, ids)
    assert torch.equal(tokens, expected)
