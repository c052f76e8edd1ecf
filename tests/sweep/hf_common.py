"""The Hugging Face programs' shared loop: AdamW training, eval + no_grad validation, greedy generate."""
from __future__ import annotations

import torch

from sweep.harness import Outcome, Probe

STEPS, WARMUP = 6, 4
BATCH, LENGTH, VOCAB = 2, 16, 128


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    train = torch.randint(0, VOCAB, (STEPS, BATCH, LENGTH), generator=g)
    val = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=g)
    return train, val, prompt


def train_validate_generate(build, device: str, probe: Probe) -> Outcome:
    torch.manual_seed(0)
    model = build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, val, prompt = data()
    losses = []
    torch.manual_seed(2)  # dropout's draws: the same stream on both devices
    for step in range(STEPS):
        if step == WARMUP:
            probe.warm()
        ids = train[step].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        ids = val.to(device)
        out = model(input_ids=ids, labels=ids)
        val_loss, val_logits = out.loss.item(), out.logits.cpu()
    tokens = model.generate(prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
                            max_new_tokens=5, do_sample=False, pad_token_id=0)
    tensors = {f"param.{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    tensors["val_logits"] = val_logits
    first = next(iter(opt.state.values()))
    tensors["adam.exp_avg_sq[0]"] = first["exp_avg_sq"].cpu()
    return Outcome(losses + [val_loss], tensors, {"generated": tokens.cpu().tolist()})
