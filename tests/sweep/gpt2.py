"""1. Hugging Face GPT-2 (default config but tiny sizes): AdamW training, validation, generate."""
import transformers

from sweep.hf_common import VOCAB, train_validate_generate


def build():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB))


def run(device, probe):
    return train_validate_generate(build, device, probe)
