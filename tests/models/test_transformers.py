"""Hugging Face Transformers models trained and generating on `neuron` in every engine mode."""
import pytest
import torch
import transformers

import tilewise

from .helpers import (BITWISE, FLOAT32_TOLERANCE, LAZY_MODES, MODES, assert_compiled_if_lazy, assert_same_training,
                      neuron_copy, train_on_cpu_and_neuron)
from .hf_models import CASES, VOCAB, batch, build, step_loss

STEPS = 5  # the first step creates the AdamW state; adaptive mode compiles after 3 identical steps
NEW_TOKENS = 4


def _adamw(params):
    # Adam divides each gradient by its own magnitude, so a gradient that is almost all rounding
    # gets a large step whose size is that rounding: attention's key bias (zero gradient in exact
    # arithmetic, as softmax ignores a shift shared by a row: computed ~1e-11), or a GPT-2 weight
    # whose gradient cancels to 3.7e-7 (median 5.7e-3), 1-3% apart between two summation orders.
    # With eps=1e-5 such gradients take small steps, and two correct programs agree to float32
    # tolerance.
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


# The heaviest (8-17 s each on 2 cores) run only without -m "not slow"; GPT-2 in every mode and
# every model in eager mode stay in CI.
# Of the families added later (5-27 s in a lazy mode), Phi-3 alone keeps its lazy modes in CI.
SLOW_TRAINING = {("t5", "adaptive"), ("t5", "compiled"), ("bert", "adaptive"), ("bert", "compiled"),
                 ("llama", "adaptive")} | {(name, mode) for name in ("mistral", "gemma", "gpt_neox", "whisper", "vit",
                                                                     "wav2vec2_ctc") for mode in LAZY_MODES}
# generation in compiled mode, 4-5 s each, of the families added later
SLOW_GENERATION = {(name, "compiled") for name in ("mistral", "gemma", "phi3", "gpt_neox")}


def _marks(name, mode):
    return [pytest.mark.slow] if (name, mode) in SLOW_TRAINING else []


@pytest.mark.parametrize("name,mode", [pytest.param(name, mode, marks=_marks(name, mode))
                                       for name in sorted(CASES) for mode in MODES])
def test_training_matches_cpu(name, mode):
    """Eager mode runs CPU's kernels op by op, the ones CPU picks (SDPA's flash kernel, SiLU's fused
    backward: eager/kernel_choice.py): CPU's values bitwise. By default a lazy mode may run a
    region's C, within float32's tolerance (the next test holds them to CPU's bits)."""
    model = build(name)
    run, reference = train_on_cpu_and_neuron(model, step_loss(name), _adamw, mode, STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)


@pytest.fixture
def deterministic_algorithms():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


# GPT-2 and Llama: SDPA's flash kernel in their default configuration, and SiLU (Llama)
@pytest.mark.parametrize("name,mode", [pytest.param(name, mode, marks=_marks(name, mode))
                                       for name in ("gpt2", "llama") for mode in LAZY_MODES])
def test_lazy_training_under_deterministic_algorithms_is_cpu_s_bitwise(name, mode, deterministic_algorithms):
    """torch.use_deterministic_algorithms(True) keeps compiled regions on their recorded graphs:
    the lazy modes compute CPU's values bitwise, the device running the kernels CPU picks."""
    model = build(name)
    run, reference = train_on_cpu_and_neuron(model, step_loss(name), _adamw, mode, STEPS)
    assert_same_training(run, reference, **BITWISE)
    assert_compiled_if_lazy(mode)


@pytest.mark.parametrize("mode", MODES)
def test_gpt2_training_with_the_default_cache_setting_matches_cpu(mode):
    """As a user writes it: the config's use_cache=True makes the forward build a DynamicCache."""
    ids, _ = batch()

    def loss(model):
        return model(input_ids=ids.to(model.device), labels=ids.to(model.device)).loss
    run, reference = train_on_cpu_and_neuron(build("gpt2"), loss, _adamw, mode, STEPS)
    assert_same_training(run, reference)
    assert_compiled_if_lazy(mode)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_compiled_training_compiles_every_region(name):
    """Llama's attention runs CPU's flash kernel, whose decomposition laid its output out otherwise:
    the step's region failed to compile and ran eagerly (compiled mode at 44.7% of compute ops).
    Mixtral's experts gather their tokens by integer indexing (tagged as data-dependent, for masks)
    and multiply with _grouped_mm (a meta kernel for CUDA's dtypes): both ran eagerly."""
    run, reference = train_on_cpu_and_neuron(build(name), step_loss(name), _adamw, "compiled", STEPS)
    assert_same_training(run, reference)
    stats = tilewise.stats()
    assert stats.ops_eager == 0 and stats.ops_compiled > 0, stats.report()


@pytest.mark.parametrize("mode", MODES)
def test_bf16_gpt2_without_dropout_computes_cpu_s_loss_and_gradients(mode, deterministic_algorithms):
    """No dropout: CPU's SDPA takes its flash kernel, which neuron took the math path around (in
    float32 for bf16): the loss was off in its fifth digit and ~40% of the tied embedding's gradient
    by bf16 ulps, in every mode."""
    model = build("gpt2").to(torch.bfloat16).eval()
    neuron_model = neuron_copy(model)
    loss = step_loss("gpt2")
    expected = loss(model)
    expected.backward()
    with tilewise.engine(mode=mode):
        for _ in range(5):  # adaptive compiles once the step has recurred
            neuron_model.zero_grad()
            got = loss(neuron_model)
            got.backward()
    assert torch.equal(got.detach().cpu(), expected.detach())
    for (name, p), q in zip(model.named_parameters(), neuron_model.parameters()):
        assert torch.equal(q.grad.cpu(), p.grad), name
    assert_compiled_if_lazy(mode)


def _generate(model, ids):
    model.eval()
    with torch.no_grad():
        return model.generate(input_ids=ids.to(model.device), attention_mask=torch.ones_like(ids).to(model.device),
                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).cpu()


@pytest.mark.parametrize("name,mode", [
    pytest.param(name, mode, marks=[pytest.mark.slow] if (name, mode) in SLOW_GENERATION else [])
    for name in sorted(n for n, case in CASES.items() if case.generates) for mode in MODES])
def test_greedy_generate_matches_cpu(name, mode):
    model = build(name)
    ids, _ = batch()
    neuron_model = neuron_copy(model)
    expected = _generate(model, ids)
    with tilewise.engine(mode=mode):
        tokens = _generate(neuron_model, ids)
    assert torch.equal(tokens, expected)


def _embed(model, ids, mask):
    """Sentence embeddings as a retrieval service computes them: mean of the unpadded tokens."""
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
    return pooled, hidden[:, 0]


@pytest.mark.parametrize("mode", MODES)
def test_bert_embeddings_under_inference_mode_match_cpu(mode):
    """BERT's mask helper checks `padding_mask.all()` after `mask.to(device=..., dtype=bool)`: under
    inference_mode that `to` reached the device whole and made a device tensor inside a device
    tensor, and compiled mode hung compiling the check. The embeddings are read after the block
    (the lazy modes computed them there, outside inference_mode, which refused to write them)."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32)).eval()
    neuron_model = neuron_copy(model)
    batches = []
    for padded in (True, False, True, True):  # the all-ones mask takes BERT's other path
        ids, _ = batch()
        mask = torch.ones_like(ids)
        if padded:
            mask[0, 5:] = 0
        batches.append((ids, mask))
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        got = [_embed(neuron_model, ids.to("neuron"), mask.to("neuron")) for ids, mask in batches]
    for (ids, mask), embeddings in zip(batches, got):
        for g, w in zip(embeddings, _embed(model, ids, mask)):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-5)
    assert_compiled_if_lazy(mode)


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_long_greedy_generation_compiles_its_decode_step_once_for_every_length(name, mode):
    """Each decode step's region meets a longer cache and takes the last token as a (1, 1) view
    starting one element further in a row one element longer: one shape-generic compile serves
    every length (its inputs share storage, read only; its guards leave offsets and size-1 strides
    free). Until 2026-12-04 adaptive mode compiled none of it and compiled mode compiled each
    length up to its recompile limit."""
    torch.manual_seed(0)
    model = build(name).eval()
    neuron_model = neuron_copy(model)
    ids = torch.arange(3, 9).reshape(1, 6)

    def generate(model):
        with torch.no_grad():
            return model.generate(ids.to(model.device), max_new_tokens=20, do_sample=False, pad_token_id=0).cpu()

    expected = generate(model)
    with tilewise.engine(mode=mode):
        tokens = generate(neuron_model)
    assert torch.equal(tokens, expected)
    stats = tilewise.stats()
    # 20 lengths: compiles are per region site (the step, the prefill, small ones), not per length
    assert stats.compiled_fraction > 0.8 and stats.compiles <= 12, stats.report()
    # and each new length's tile programs are evaluated from the site's parametric program (a
    # symbolic layout asked of a launch's concrete resident values raised TypeError, SymInt's hash)
    assert stats.evaluated_sizes >= 10 and not stats.not_parametric, stats.report()


GPT2_124M_STEPS = 4  # adaptive mode compiles the step once it has recurred three times


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_full_size_gpt2_training_matches_cpu(mode):
    """GPT-2 at its published size (GPT2Config()'s defaults: 124M parameters, 50257-token vocabulary,
    dropout 0.1), batch 2 of 64 tokens, AdamW."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert 124e6 < sum(p.numel() for p in model.parameters()) < 125e6
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))

    def loss(model):
        return model(input_ids=ids.to(model.device), labels=ids.to(model.device), use_cache=False).loss
    run, reference = train_on_cpu_and_neuron(model, loss, _adamw, mode, GPT2_124M_STEPS)
    assert_same_training(run, reference, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)


def test_batched_padded_mistral_generation_runs_compiled_once_warm():
    """Batch 2, left-padded, greedy: each decode step takes the last tokens as `ids[:, -1:]`, a
    (2, 1) view whose row stride is the length so far, and adds the length to the positions as a
    Python int (add.Tensor(positions, 11)). The stride was pinned by the shape-generic compile's
    guards (two generalisations, then eager) and the int kept its node out of every region:
    adaptive mode ran 46% of a warm generation compiled (94% with the int alone made symbolic, a
    region analysed again at every step as its guards missed), 97% now."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    neuron_model = neuron_copy(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])

    def generate(model):
        with torch.no_grad():
            return model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                  max_new_tokens=20, do_sample=False, pad_token_id=0).cpu()

    expected = generate(model)
    with tilewise.engine(mode="adaptive"):
        first = generate(neuron_model)
        tilewise.stats().reset()
        warm = generate(neuron_model)
    assert torch.equal(first, expected) and torch.equal(warm, expected)
    stats = tilewise.stats()
    assert stats.compiled_fraction >= 0.9 and stats.evaluated_sizes >= 10, stats.report()
    assert not stats.guard_misses and stats.analyses < 15, stats.report()
