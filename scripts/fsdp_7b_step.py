"""One FSDP2 training step of the real-dimension PersonaPlex 7B (random weights) on several GPUs.

Run with ``torchrun --nproc-per-node 2 scripts/fsdp_7b_step.py [--frames 256] [--steps 3] [--out JSON]``. It uses
the training code's own pieces (``TrainModule``, ``enable_activation_checkpointing``, ``apply_fsdp``,
``LMModel.forward_delayed``): the model is built on the meta device, sharded, materialised directly on each GPU
with a cheap random init (no rank ever holds the full 8.4 B parameters), and trained for a few AdamW steps on a
random delayed sequence under bf16 autocast. Rank 0 prints (and writes) the step times and the peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import date

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cspan.core.config import LMConfig
from cspan.core.lm import LMModel
from cspan.train.train import TrainModule, apply_fsdp, enable_activation_checkpointing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=256, help="sequence length in frames")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (the first one warms up)")
    parser.add_argument("--dep-q", type=int, default=16, help="16 (PersonaPlex shape) or 8 (Moshi shape)")
    parser.add_argument("--config", default=None, help="an LM config.json instead of the 7B preset (smoke tests)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu runs on gloo (smoke tests)")
    parser.add_argument("--out", default=None, help="JSON file for the numbers (rank 0)")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")

    if args.config:
        with open(args.config) as f:
            cfg = LMConfig.from_upstream(json.load(f))
    else:
        cfg = LMConfig.personaplex_7b() if args.dep_q == 16 else LMConfig.moshi_7b()
    with torch.device("meta"):
        lm = LMModel(cfg, device="meta", dtype=torch.float32)
    n_params = sum(p.numel() for p in lm.parameters())
    lm.train()
    enable_activation_checkpointing(lm)
    module = TrainModule(lm)
    apply_fsdp(lm, module, device.type, world)
    module.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    with torch.no_grad():
        for name, p in module.named_parameters():
            local_p = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith("alpha") or "norm" in name:
                local_p.fill_(1.0)
            else:
                local_p.normal_(0.0, 0.02, generator=gen)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5, weight_decay=0.0)

    K, L = cfg.n_q + 1, args.frames
    tok_gen = torch.Generator(device=device).manual_seed(99)
    text = torch.randint(0, cfg.text_card, (1, 1, L + 1), device=device, generator=tok_gen)
    audio = torch.randint(0, cfg.card, (1, K - 1, L + 1), device=device, generator=tok_gen)
    delayed = torch.cat([text, audio], dim=1)
    inputs, targets = delayed[:, :, :-1], delayed[:, :, 1:]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    times: list[float] = []
    losses: list[float] = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            text_logits, audio_logits = module(inputs, targets)
        loss = F.cross_entropy(text_logits.float().reshape(-1, text_logits.shape[-1]), targets[:, 0].reshape(-1))
        audio_t = targets[:, 1 : 1 + cfg.dep_q]
        loss = loss + F.cross_entropy(audio_logits.float().reshape(-1, audio_logits.shape[-1]), audio_t.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    peaks = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([float(peak)], device=device))
    if rank == 0:
        result = {
            "date": date.today().isoformat(),
            "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
            "world_size": world,
            "torch": torch.__version__,
            "parameters": n_params,
            "frames": L,
            "dep_q": cfg.dep_q,
            "precision": "fp32 master weights + AdamW state, bf16 autocast, activation checkpointing",
            "step_s": times,
            "loss": losses,
            "peak_memory_gib_per_rank": [float(p.item()) / 2**30 for p in peaks],
        }
        print(json.dumps(result, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
