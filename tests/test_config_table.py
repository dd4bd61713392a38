"""The migration table in docs/ is the one the schema renders (one source)."""

from meshzero.config import load_config
from meshzero.config.compat import HINTS, NOOP_VALUES
from meshzero.config.table import render
from meshzero.config.unsupported import UNSUPPORTED_KEYS
from tests.distributed import REPO_ROOT

DOCS = REPO_ROOT / "docs" / "migration-keys.md"


def test_docs_copy_is_current() -> None:
    assert DOCS.read_text() == render(), (
        "docs/migration-keys.md is stale: run python -m meshzero.config.table "
        "docs/migration-keys.md")


def test_every_key_class_is_in_the_table() -> None:
    text = render()
    for key in [*HINTS, *NOOP_VALUES, *UNSUPPORTED_KEYS, "stage3_gather_16bit_weights_on_"
                "model_save", "prescale_gradients", "csv_monitor"]:
        assert f"`{key}" in text or key in text, key


def test_hint_and_noop_keys_load_and_refused_keys_do_not() -> None:
    """What the table says of a key is what load_config does with it."""
    for key in HINTS:
        if key.startswith(("zero_optimization.offload", "bf16.")):
            continue  # need their parent block; covered by test_config_compat
        load_config(_nested(key, False))
    for key in UNSUPPORTED_KEYS:
        try:
            # a dotted key's True, or False where True is its no-op (DeepCompile's defaults)
            on = NOOP_VALUES.get(key, ()) != (True,)
            load_config(_nested(key, {"enabled": True} if "." not in key else on))
        except ValueError as exc:
            assert key in str(exc)
        else:
            raise AssertionError(f"{key} loaded")


def _nested(dotted: str, value: object) -> dict:
    out: dict = {}
    node = out
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {"type": "WarmupLR"} if part == "scheduler" else {})
    node[last] = value
    return out
