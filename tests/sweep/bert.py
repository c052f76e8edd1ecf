"""9. Hugging Face BERT fine-tuning for sequence classification, as the tutorials write it: padded
batches with an attention mask, AdamW with weight decay groups, a linear schedule with warm-up,
gradient accumulation over two micro-batches, gradient clipping, then evaluation with argmax
accuracy."""
import torch
import transformers

from sweep.harness import Outcome, Tolerance

STEPS, WARMUP, ACCUMULATE = 6, 4, 2
BATCH, LENGTH, VOCAB, CLASSES = 4, 12, 96, 3
TOLERANCE = Tolerance(rtol=1e-4, atol=2e-5)


def build():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=CLASSES)
    return transformers.BertForSequenceClassification(config)


def batches():
    """Micro-batches of token ids padded to LENGTH, their attention masks and labels."""
    g = torch.Generator().manual_seed(3)
    made = []
    for _ in range(STEPS * ACCUMULATE + 1):
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (BATCH,), generator=g)
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        made.append((ids * mask, mask, torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return made


def run(device, probe):
    torch.manual_seed(0)
    model = build().to(device)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=5e-4)
    schedule = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    data = batches()
    losses, norms = [], []
    torch.manual_seed(2)  # dropout's draws: the same stream on both devices
    model.train()
    for step in range(STEPS):
        if step == WARMUP:
            probe.warm()
        for micro in range(ACCUMULATE):
            ids, mask, labels = (t.to(device) for t in data[step * ACCUMULATE + micro])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / ACCUMULATE
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    ids, mask, labels = (t.to(device) for t in data[-1])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    accuracy = (logits.argmax(-1) == labels).float().mean().item()
    tensors = {f"param.{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    tensors["eval_logits"] = logits.cpu()
    return Outcome(losses + norms + [accuracy], tensors, {"lr": schedule.get_last_lr()})
