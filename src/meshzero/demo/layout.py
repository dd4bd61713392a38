"""How the demo GPT is cut into pipeline stages, passed to ``initialize(pipeline_layout=...)``,
``build_pipeline(layout=...)`` and the estimator like any model's layout. (Its
tensor-parallel plan is the shipped plan "gpt", ``meshzero.parallel.plans.GPT_PLAN``.)"""

from __future__ import annotations

import torch
from torch import nn

from meshzero.parallel.pipeline_split import PipelineLayout


def gpt_embed(stage: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """(B, T) bytes -> (B, T, C): token + position embeddings of the demo GPT."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    return stage.get_submodule("tok_emb")(idx) + stage.get_submodule("pos_emb")(pos)


# Embeddings on the first stage, ln_f + head on the last; the head is tied to tok_emb, so
# both ends hold that tensor (see Pipeline's tied grads).
GPT_LAYOUT = PipelineLayout(
    layers="blocks", first=("tok_emb", "pos_emb"), first_fn=gpt_embed, last=("ln_f", "head")
)
