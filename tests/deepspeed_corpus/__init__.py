"""The DeepSpeed API corpus (calls.py) and one check per entry that makes the call as the
project makes it, through ``import meshzero.deepspeed as deepspeed``.

``python -m tests.deepspeed_corpus`` prints which entries work; tests/test_deepspeed_corpus.py
holds the count to a floor.
"""
