"""What the FP8 KV cache changes: text-logit differences and greedy token agreement against the model-dtype cache.

Two engines over the same model, one with the model-dtype KV cache (A) and one with ``kv_dtype="fp8"`` (B), read
the same stream: ``--steps`` greedy steps with random user codes, and Context Spans of 64 and 200 columns at steps
100 and 300 (read in the step, as in a conversation).

- teacher-forced: B is forced with A's columns, so both read the same token history: the max and mean absolute
  text-logit difference per step (and relative to the logits' max magnitude), and how often B's own greedy text
  token (the argmax of its logits) equals A's;
- free-running: both decode greedily on their own: the share of steps whose text token, and of (step, codebook)
  entries whose agent audio code, are equal, and the first step where the text differs.

Usage (from the repository root):

    python scripts/fp8_kv.py --reference lm-moshi-shaped lm-personaplex-shaped     # CPU, float32 fixtures
    python scripts/fp8_kv.py --random-7b                                             # GPU, bf16 random 7B

The fixtures are ``../shared/fixtures/reference/<name>`` (``--fixtures`` to point elsewhere). ``--out`` writes
the JSON. Random weights make near-flat logits, so greedy agreement is a pessimistic measure of what FP8 changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cspan.core.engine import DuplexEngine
from cspan.core.span import ContextSpan

SPANS = {100: 64, 300: 200}


def _lm_from_fixture(folder: Path) -> torch.nn.Module:
    from safetensors.torch import load_file

    from cspan.core.config import LMConfig
    from cspan.core.lm import LMModel

    cfg = LMConfig.from_upstream(json.loads((folder / "config.json").read_text()))
    lm = LMModel(cfg, dtype=torch.float32).eval()
    lm.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    return lm


def _engine(lm: torch.nn.Module, kv: str) -> DuplexEngine:
    card = int(lm.card)
    placeholder = {} if card >= 2048 else {"agent_placeholder": [1] * 8, "user_placeholder": [2] * 8}
    return DuplexEngine(lm, temp=0, temp_text=0, kv_dtype=kv, predict_user=lm.dep_q > 8, **placeholder)


def _span(n: int, text_card: int, step: int) -> ContextSpan:
    g = torch.Generator().manual_seed(step)
    return ContextSpan.from_ids(torch.randint(min(32, text_card - 1), text_card, (n - 2,), generator=g).tolist())


@torch.no_grad()
def measure(lm: torch.nn.Module, steps: int, seed: int = 0) -> dict:
    """The two comparisons of the module docstring for one model."""
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(0, int(lm.card), (steps, 1, 8), generator=g).to(lm.device)
    text_card = int(lm.text_card)
    forced_diffs, forced_rel, forced_agree = [], [], 0
    a, b = _engine(lm, "auto"), _engine(lm, "fp8")
    for t in range(steps):
        if t in SPANS:
            for e in (a, b):
                e.inject_span(0, _span(SPANS[t], text_card, t))
        oa = a.step_tokens(user[t])
        ob = b.step_tokens(user[t], oa.column)  # the same history: B forced with A's column
        la, lb = oa.text_logits.float(), ob.text_logits.float()
        d = (la - lb).abs().max().item()
        forced_diffs.append(d)
        forced_rel.append(d / max(la.abs().max().item(), 1e-12))
        forced_agree += int(la.argmax(-1).item() == lb.argmax(-1).item())
    a, b = _engine(lm, "auto"), _engine(lm, "fp8")
    text_eq = audio_eq = 0
    first = None
    for t in range(steps):
        if t in SPANS:
            for e in (a, b):
                e.inject_span(0, _span(SPANS[t], text_card, t))
        ca, cb = a.step_tokens(user[t]).column, b.step_tokens(user[t]).column
        same_text = bool(ca[0, 0] == cb[0, 0])
        text_eq += int(same_text)
        audio_eq += int((ca[0, 1:9] == cb[0, 1:9]).sum().item())
        if first is None and not same_text:
            first = t
    return {
        "steps": steps,
        "spans": {str(k): v for k, v in SPANS.items() if k < steps},
        "forced_text_logit_max_abs_diff": max(forced_diffs),
        "forced_text_logit_mean_of_step_max_abs_diff": sum(forced_diffs) / steps,
        "forced_text_logit_max_relative_diff": max(forced_rel),
        "forced_greedy_text_agreement": forced_agree / steps,
        "free_text_agreement": text_eq / steps,
        "free_agent_audio_agreement": audio_eq / (8 * steps),
        "free_first_text_divergence_step": first,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--reference", nargs="+", help="fixture folders under --fixtures (CPU, float32)")
    src.add_argument("--random-7b", action="store_true", help="the PersonaPlex-shaped 7B with random weights (GPU)")
    p.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared/fixtures")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    if args.random_7b:
        from cspan.bench.latency import random_lm
        from cspan.core.config import LMConfig

        lm = random_lm(LMConfig.personaplex_7b(), "cuda", torch.bfloat16)
        results["random-7b (bf16)"] = measure(lm, args.steps)
    else:
        for name in args.reference:
            results[f"{name} (float32)"] = measure(_lm_from_fixture(args.fixtures / "reference" / name), args.steps)
    print("| model | steps | forced: max abs text-logit diff (relative) | forced: greedy text agreement | "
          "free: text agreement | free: agent audio agreement | free: first text divergence |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['steps']} | {r['forced_text_logit_max_abs_diff']:.3g} "
            f"({r['forced_text_logit_max_relative_diff']:.2%}) | {r['forced_greedy_text_agreement']:.1%} | "
            f"{r['free_text_agreement']:.1%} | {r['free_agent_audio_agreement']:.1%} | "
            f"{r['free_first_text_divergence_step']} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
