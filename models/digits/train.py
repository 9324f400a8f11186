"""Train the bundled `digits` model: a small MLP on scikit-learn's 8x8 digits.

Writes `model.pt` (TorchScript, raw 0-16 pixels in, class probabilities out) and
`holdout.npz` (held-out X float32 / y int64) next to this script.

Usage: python models/digits/train.py
"""

from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

HERE = Path(__file__).resolve().parent
SEED = 0
EPOCHS = 60
BATCH_SIZE = 64


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def logits(self, pixels: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.net(pixels / 16.0)
        return logits

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(pixels), dim=1)


def train(x: np.ndarray, y: np.ndarray) -> DigitsMLP:
    model = DigitsMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    for _ in range(EPOCHS):
        for idx in torch.split(torch.randperm(len(xt), generator=generator), BATCH_SIZE):
            optimizer.zero_grad()
            loss_fn(model.logits(xt[idx]), yt[idx]).backward()
            optimizer.step()
    return model.eval()


def main() -> None:
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=SEED)

    model = train(x_train, y_train)
    with torch.inference_mode():
        predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    accuracy = float((predicted == y_test).mean())
    print(f"held-out accuracy: {accuracy:.4f} ({len(y_test)} rows)")
    if accuracy < 0.95:
        raise SystemExit("accuracy below 0.95; not exporting")

    torch.jit.save(torch.jit.script(model), str(HERE / "model.pt"))
    np.savez_compressed(HERE / "holdout.npz", X=x_test, y=y_test)
    print(f"wrote {HERE / 'model.pt'} and {HERE / 'holdout.npz'}")


if __name__ == "__main__":
    main()
