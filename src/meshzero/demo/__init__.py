"""``meshzero demo``: a small byte-level GPT trained with ZeRO on the Python standard
library's own source, launched through PyTorch's elastic launcher (see run.py)."""
