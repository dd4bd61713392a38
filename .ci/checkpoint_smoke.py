"""The fresh-environment check's checkpoint round trip (.ci/fresh-env runs it).

    torchrun --nproc-per-node 2 .ci/checkpoint_smoke.py save DIR
        train a small MLP two steps with ZeRO-3 on the ranks, save a sharded checkpoint in
        DIR/ckpt and (rank 0) the full fp32 weights in DIR/reference.safetensors
    python .ci/checkpoint_smoke.py check DIR
        after ``meshzero consolidate DIR/ckpt DIR/out``: the consolidated weights equal the
        reference bit for bit

Only the runtime dependencies may be imported here: this is what finds an undeclared one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

DIM = 16


def save(root: Path) -> None:
    import torch.distributed as dist

    import meshzero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = meshzero.initialize(model=model, config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(2):
        x = torch.randn(micro, DIM, generator=torch.Generator().manual_seed(
            step * 100 + dist.get_rank()))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(root / "ckpt")
    state = engine.full_state_dict()  # a collective: every rank takes part
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()},
                  str(root / "reference.safetensors"))
    dist.destroy_process_group()


def check(root: Path) -> None:
    reference = load_file(str(root / "reference.safetensors"))
    files = sorted((root / "out").glob("*.safetensors"))
    if not files:
        sys.exit(f"no safetensors file under {root / 'out'}")
    got: dict[str, torch.Tensor] = {}
    for file in files:
        got.update(load_file(str(file)))
    if got.keys() != reference.keys():
        sys.exit(f"consolidated names {sorted(got)} != saved names {sorted(reference)}")
    for name, tensor in reference.items():
        if not torch.equal(got[name], tensor):
            sys.exit(f"{name}: the consolidated tensor differs from the trained one")
    print(f"consolidated {len(got)} tensors equal the trained weights")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "check"):
        sys.exit(f"usage: {sys.argv[0]} save|check DIR")
    (save if sys.argv[1] == "save" else check)(Path(sys.argv[2]))
