"""Tiny random-initialised Hugging Face models, built from configs (no download).

Each keeps its architecture's default configuration (attention implementation, activation,
dropout, cache) except for the sizes, which are made tiny.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import transformers

VOCAB = 64
BATCH, LENGTH = 2, 8


@dataclass(frozen=True)
class HFCase:
    name: str
    build: Callable[[], torch.nn.Module]
    causal: bool = False  # predicts its own input (shifted inside the model) rather than labels
    # Passed to forward in training; the cache is left to generate(), which exercises it.
    train_kwargs: dict = field(default_factory=dict)
    # The forward's inputs and labels, on the CPU; by default token ids.
    inputs: Callable[[], dict] | None = None
    generates: bool = True  # a text model that greedy generation is tested on


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _mixtral():
    # its default experts: tokens counted per expert by histc (of int32 ids off the CPU), _grouped_mm
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32))


def _mistral():
    # sliding-window attention, narrower than the sequence so that the window masks
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, sliding_window=4))


def _gemma():
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32))


def _phi3():
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, original_max_position_embeddings=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))


def _gpt_neox():
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, bos_token_id=1, eos_token_id=2))


MEL_BINS, AUDIO_FRAMES = 8, 16  # Whisper's encoder takes exactly 2 * max_source_positions frames


def _whisper():
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=AUDIO_FRAMES // 2, max_target_positions=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None))


def _whisper_inputs():
    generator = torch.Generator().manual_seed(1)
    return {"input_features": torch.randn(BATCH, MEL_BINS, AUDIO_FRAMES, generator=generator),
            "labels": torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)}


IMAGE, CLASSES = 8, 4


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=IMAGE,
        patch_size=4, num_labels=CLASSES))


def _vit_inputs():
    generator = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=generator)}


def _wav2vec2():
    # its defaults otherwise: group-norm feature encoder, SpecAugment time masks (drawn with numpy)
    # and layer drop in training, CTC loss
    return transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, pad_token_id=0))


def _wav2vec2_inputs():
    generator = torch.Generator().manual_seed(1)
    return {"input_values": torch.randn(BATCH, 400, generator=generator),  # 48 frames
            "labels": torch.randint(1, 16, (BATCH, 6), generator=generator)}


CASES = {case.name: case for case in (
    HFCase("gpt2", _gpt2, causal=True, train_kwargs={"use_cache": False}),
    HFCase("llama", _llama, causal=True, train_kwargs={"use_cache": False}),
    HFCase("bert", _bert, generates=False),
    HFCase("t5", _t5, train_kwargs={"use_cache": False}),
    HFCase("mixtral", _mixtral, causal=True, train_kwargs={"use_cache": False}),
    HFCase("mistral", _mistral, causal=True, train_kwargs={"use_cache": False}),
    HFCase("gemma", _gemma, causal=True, train_kwargs={"use_cache": False}),
    HFCase("phi3", _phi3, causal=True, train_kwargs={"use_cache": False}),
    HFCase("gpt_neox", _gpt_neox, causal=True, train_kwargs={"use_cache": False}),
    HFCase("whisper", _whisper, train_kwargs={"use_cache": False}, inputs=_whisper_inputs, generates=False),
    HFCase("vit", _vit, inputs=_vit_inputs, generates=False),
    HFCase("wav2vec2_ctc", _wav2vec2, inputs=_wav2vec2_inputs, generates=False),
)}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CASES[name].build()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels, on the CPU."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    labels = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    return ids, labels


def step_loss(name: str) -> Callable[[torch.nn.Module], torch.Tensor]:
    """The loss of one training step: causal LMs predict their input, the others the labels."""
    case = CASES[name]
    if case.inputs:
        inputs = case.inputs()
    else:
        ids, labels = batch()
        inputs = {"input_ids": ids, "labels": ids if case.causal else labels}

    def loss(model):
        return model(**{k: v.to(model.device) for k, v in inputs.items()}, **case.train_kwargs).loss
    return loss
