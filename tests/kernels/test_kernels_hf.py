"""A Hugging Face Llama (SDPA attention, grouped-query heads) trains on neuron through the
FlashAttention kernel (attention_kernel = "flash") in every mode, its losses equal to CPU's within
1e-4 (the kernel sums in another order than CPU's attention)."""
import pytest
import torch

import tilewise

transformers = pytest.importorskip("transformers")


def _losses(device: str, steps: int) -> list[float]:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 32), generator=generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["eager", "adaptive", "compiled"])
def test_llama_trains_through_flash_attention(mode):
    steps = 20
    want = _losses("cpu", steps)
    with tilewise.config.patch(attention_kernel="flash"), tilewise.engine(mode=mode):
        got = _losses("neuron", steps)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    stats = tilewise.stats()
    assert stats.tile_kernels["flash_fwd"] >= 2 * steps and stats.tile_kernels["flash_bwd"] >= 2 * steps
    assert not stats.tile_kernels_declined
    if mode != "eager":
        assert stats.compiles >= 1


def test_gpt2_trains_and_generates_through_flash_attention():
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     attn_implementation="sdpa", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                     bos_token_id=0, eos_token_id=0)

    def run(device):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            ids = torch.randint(0, 128, (2, 32), generator=generator).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        model.eval()
        return losses, model.generate(torch.tensor([[1, 2, 3]]).to(device), max_new_tokens=8, do_sample=False).cpu()

    want_losses, want_tokens = run("cpu")
    with tilewise.config.patch(attention_kernel="flash"), tilewise.engine(mode="eager"):
        losses, tokens = run("neuron")
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-4
    assert torch.equal(tokens, want_tokens)
    assert tilewise.stats().tile_kernels["flash_fwd"] > tilewise.stats().tile_kernels["flash_bwd"]  # generate
    assert not tilewise.stats().tile_kernels_declined
