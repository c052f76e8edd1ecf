"""2. Hugging Face Llama (tiny: hidden 64, 2 layers, 2 heads, 1 kv head): training, validation, generate."""
import transformers

from sweep.hf_common import VOCAB, train_validate_generate


def build():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64))


def run(device, probe):
    return train_validate_generate(build, device, probe)
