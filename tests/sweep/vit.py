"""10. A small vision transformer written with torch.nn, as the tutorials do: Conv2d patches, a class
token and learned positions, nn.TransformerEncoder (batch_first, GELU, norm_first), label
smoothing, AdamW with a OneCycle schedule; validation in eval mode under no_grad, where
nn.TransformerEncoder takes PyTorch's fused fast path (`_transformer_encoder_layer_fwd`) on
neuron as on CUDA, and a key padding mask."""
import torch
from torch import nn

from sweep.harness import Outcome, Tolerance

STEPS, WARMUP = 6, 4
TOLERANCE = Tolerance(rtol=1e-4, atol=2e-5)


class ViT(nn.Module):
    def __init__(self, classes=5, dim=32, patch=4, image=16):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 2, dim * 2, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, classes))

    def forward(self, images, padding=None):
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.encoder(x, src_key_padding_mask=padding)[:, 0])


def run(device, probe):
    torch.manual_seed(0)
    model = ViT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(STEPS + 1)]
    losses = []
    torch.manual_seed(2)
    model.train()
    for step, (x, y) in enumerate(data[:-1]):
        if step == WARMUP:
            probe.warm()
        loss = loss_fn(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    x, y = data[-1]
    padding = torch.zeros(4, 17, dtype=torch.bool)
    padding[:2, -3:] = True  # the last patches of two images masked out
    with torch.no_grad():
        logits = model(x.to(device))
        masked = model(x.to(device), padding.to(device))
    tensors = {f"param.{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    tensors["eval_logits"], tensors["masked_logits"] = logits.cpu(), masked.cpu()
    return Outcome(losses, tensors, {"predicted": logits.argmax(-1).cpu().tolist()})
