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


CASES = {case.name: case for case in (
    HFCase("gpt2", _gpt2, causal=True, train_kwargs={"use_cache": False}),
    HFCase("llama", _llama, causal=True, train_kwargs={"use_cache": False}),
    HFCase("bert", _bert),
    HFCase("t5", _t5, train_kwargs={"use_cache": False}),
    HFCase("mixtral", _mixtral, causal=True, train_kwargs={"use_cache": False}),
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
    ids, labels = batch()

    def loss(model):
        device = model.device
        target = ids if case.causal else labels
        return model(input_ids=ids.to(device), labels=target.to(device), **case.train_kwargs).loss
    return loss
