"""A small convolutional VQ-VAE frame tokenizer (32x32 RGB -> 8x8 codes), the alternative to the k-means
patch codebook (`tokenizer.PatchTokenizer`), with the same encode / decode / tokens_per_frame interface.

Why it exists: a k-means codebook quantises each 4x4 patch alone, so its reconstructions are blocky; a
decoder that sees neighbouring codes can smooth the seams and a learnt encoder can spend codes on what the
decoder cannot infer. It is only used where it measures better (reconstruction PSNR on held-out clips).
Codes stay on the 8x8 raster (stride-4 encoder, receptive field a few patches), so slot = position in frame.
EMA codebook updates with dead-code restarts (the usual recipe that trains without codebook collapse).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from fastcar_compile.core.atomic import atomic_path
from fastcar_compile.core.errors import FastCarError
from fastcar_compile.demo.tokenizer import PatchTokenizer, check_tokens

DIM = 32  # code vector size
WIDTH = 64  # conv channels


def _net(codes: int):
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Sequential(
                nn.Conv2d(3, WIDTH, 4, 2, 1), nn.ReLU(), nn.Conv2d(WIDTH, WIDTH, 4, 2, 1), nn.ReLU(),
                nn.Conv2d(WIDTH, WIDTH, 3, 1, 1), nn.ReLU(), nn.Conv2d(WIDTH, DIM, 1))
            self.dec = nn.Sequential(
                nn.Conv2d(DIM, WIDTH, 3, 1, 1), nn.ReLU(), nn.Conv2d(WIDTH, WIDTH, 3, 1, 1), nn.ReLU(),
                nn.ConvTranspose2d(WIDTH, WIDTH, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(WIDTH, 3, 4, 2, 1))
            self.register_buffer("codebook", torch.randn(codes, DIM) * 0.1)

        def quantise(self, z):  # z [N, DIM, g, g] -> codes [N, g, g]
            flat = z.permute(0, 2, 3, 1).reshape(-1, DIM)
            d = (self.codebook**2).sum(1)[None] - 2 * flat @ self.codebook.T
            return d.argmin(1).reshape(z.shape[0], z.shape[2], z.shape[3])

        def embed(self, codes):  # [N, g, g] -> [N, DIM, g, g]
            return self.codebook[codes].permute(0, 3, 1, 2)

    return Net()


def _to_tensor(frames: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(frames)).float().div(255).permute(0, 3, 1, 2) - 0.5


class VQVAETokenizer:
    """Frame [H, W, 3] uint8 <-> token grid [H/4 * W/4] int64 (raster order), torch on CPU."""

    def __init__(self, net, frame: int = 32) -> None:
        self.net = net.eval()
        self.frame = frame

    @property
    def vocab(self) -> int:
        return int(self.net.codebook.shape[0])

    @property
    def tokens_per_frame(self) -> int:
        return (self.frame // 4) ** 2

    def encode(self, frames: np.ndarray) -> np.ndarray:
        """[..., H, W, 3] uint8 -> [..., L] int64 codes."""
        import torch

        frames = np.asarray(frames)
        if frames.shape[-3:] != (self.frame, self.frame, 3):
            raise FastCarError(f"frames must be [..., {self.frame}, {self.frame}, 3], got {frames.shape}")
        lead = frames.shape[:-3]
        flat = frames.reshape(-1, self.frame, self.frame, 3)
        out = []
        with torch.no_grad():
            for i in range(0, len(flat), 512):
                out.append(self.net.quantise(self.net.enc(_to_tensor(flat[i:i + 512]))).reshape(-1,
                           self.tokens_per_frame))
        return torch.cat(out).numpy().astype(np.int64).reshape(*lead, self.tokens_per_frame)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """[..., L] codes -> [..., H, W, 3] uint8."""
        import torch

        tokens = check_tokens(tokens, self.tokens_per_frame, self.vocab)
        lead, g = tokens.shape[:-1], self.frame // 4
        flat = torch.from_numpy(tokens.reshape(-1, g, g).astype(np.int64))
        with torch.no_grad():
            img = torch.cat([self.net.dec(self.net.embed(flat[i:i + 512])) for i in range(0, len(flat), 512)])
        img = (img + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        return (img * 255 + 0.5).astype(np.uint8).reshape(*lead, self.frame, self.frame, 3)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic .npz of the fp16 weights (the measured network is the fp16-rounded one, see train_vqvae)."""
        sd = {k: v.detach().half().numpy() for k, v in self.net.state_dict().items()}
        with atomic_path(path, ".npz") as tmp:
            np.savez(tmp, frame=np.int64(self.frame), **sd)

    @classmethod
    def load(cls, path: str | os.PathLike) -> VQVAETokenizer:
        import torch

        if not Path(path).exists():
            raise FastCarError(f"tokenizer file {path} not found; run scripts/train_video_model.py tokenizer")
        z = np.load(path)
        net = _net(int(z["codebook"].shape[0]))
        net.load_state_dict({k: torch.from_numpy(z[k].astype(np.float32)) for k in net.state_dict()})
        return cls(net, int(z["frame"]))


def train_vqvae(frames: np.ndarray, codes: int = 512, steps: int = 1500, batch: int = 128,
                lr: float = 2e-3, seed: int = 0, log: list | None = None) -> VQVAETokenizer:
    """Train on frames [N, 32, 32, 3] uint8 for `steps` steps (seeded batch order and init).

    Loss: MSE reconstruction + 0.25 commitment, straight-through gradients; the codebook follows the
    encoder outputs by EMA (decay 0.99) and codes unused for 20 steps restart at random encoder outputs.
    """
    import torch

    torch.manual_seed(seed)
    net = _net(codes)
    x_all = _to_tensor(frames)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # codebook starts at encoder outputs of random frames
        z0 = net.enc(x_all[torch.randint(0, len(x_all), (256,), generator=gen)]).permute(0, 2, 3, 1)
        net.codebook.copy_(z0.reshape(-1, DIM)[torch.randperm(z0.numel() // DIM, generator=gen)[:codes]])
    ema_sum, ema_n = net.codebook.clone(), torch.ones(codes)
    idle = torch.zeros(codes)
    params = list(net.enc.parameters()) + list(net.dec.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    t0, step = time.time(), 0
    while step < steps:
        x = x_all[torch.randint(0, len(x_all), (batch,), generator=gen)]
        z = net.enc(x)
        k = net.quantise(z.detach())
        q = net.embed(k)
        zq = z + (q - z).detach()
        rec = net.dec(zq)
        loss = torch.nn.functional.mse_loss(rec, x) + 0.25 * torch.nn.functional.mse_loss(z, q)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            flat = z.detach().permute(0, 2, 3, 1).reshape(-1, DIM)
            onehot = torch.nn.functional.one_hot(k.reshape(-1), codes).float()
            cnt = onehot.sum(0)
            ema_n.mul_(0.99).add_(cnt, alpha=0.01)
            ema_sum.mul_(0.99).add_(onehot.T @ flat, alpha=0.01)
            net.codebook.copy_(ema_sum / ema_n.clamp_min(1e-5)[:, None])
            idle = torch.where(cnt > 0, torch.zeros_like(idle), idle + 1)
            dead = (idle >= 20).nonzero().flatten()
            if len(dead):
                pick = flat[torch.randint(0, len(flat), (len(dead),), generator=gen)]
                net.codebook[dead] = pick
                ema_sum[dead], ema_n[dead], idle[dead] = pick, 1.0, 0
        step += 1
        if log is not None and step % 25 == 0:
            log.append({"step": step, "seconds": time.time() - t0, "mse": float(loss.item())})
        for g in opt.param_groups:  # cosine decay over the steps
            g["lr"] = lr * 0.5 * (1 + np.cos(np.pi * step / steps))
    with torch.no_grad():  # measure what ships: fp16-rounded weights
        for v in net.state_dict().values():
            v.copy_(v.half().float())
    return VQVAETokenizer(net, frames.shape[1])


def load_frame_tokenizer(path: str | os.PathLike):
    """The tokenizer saved at `path`: a k-means PatchTokenizer or a VQVAETokenizer (told apart by its keys)."""
    if not Path(path).exists():
        raise FastCarError(f"tokenizer file {path} not found; run scripts/train_video_model.py tokenizer")
    with np.load(path) as z:
        kmeans = set(z.files) == {"codebook", "frame"}
    return PatchTokenizer.load(path) if kmeans else VQVAETokenizer.load(path)
