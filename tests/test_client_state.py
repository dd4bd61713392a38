"""client_state without pickle (meshzero.checkpoint.client_state), and DeepSpeed's
``clone_tensors_for_torch_save``, one process. The engine round trip at W = 1, 2, 4 is in
test_checkpoint_keywords.py."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

from meshzero.checkpoint.client_state import TAG, decode, encode
from meshzero.deepspeed.checkpoint_utils import clone_tensors_for_torch_save

Point = collections.namedtuple("Point", ["x", "y"])


class AttributeDict(dict):
    """Lightning's hyper_parameters container: a dict whose items read as attributes."""

    def __getattr__(self, key):
        return self[key]


def round_trip(value):
    encoded = encode(value)
    return decode(json.loads(json.dumps(encoded.json)), encoded.tensors), encoded


def test_plain_json_is_stored_as_it_is():
    value = {"a": [1, 2.5, None, True, "s"], "b": {"c": {}}}
    back, encoded = round_trip(value)
    assert encoded.json == value and back == value and not encoded.tensors


def test_one_tensor_saved_once_and_shared_back():
    t = torch.arange(4.0)
    back, encoded = round_trip({"x": t, "y": [t], "od": collections.OrderedDict(k=t[1:])})
    assert len(encoded.tensors) == 2
    assert back["x"] is back["y"][0] and torch.equal(back["x"], t)
    assert type(back["od"]) is collections.OrderedDict and torch.equal(back["od"]["k"], t[1:])


def test_dict_subclasses_and_namedtuples():
    """A defaultdict with a builtin factory, a dict subclass whose state is its items
    (Lightning's AttributeDict in its checkpoint's hyper_parameters) and a namedtuple come
    back as themselves."""
    counts = collections.defaultdict(list, {"a": [1]})
    value = {"counts": counts, "hp": AttributeDict(lr=0.1, sizes=(1, 2)), "p": Point(1, [2])}
    back, _ = round_trip(value)
    assert type(back["counts"]) is collections.defaultdict and back["counts"] == counts
    assert back["counts"].default_factory is list
    assert type(back["hp"]) is AttributeDict and back["hp"].sizes == (1, 2)
    assert type(back["p"]) is Point and back["p"] == Point(1, [2])


class _Tagged(dict):
    pass


def _with_attribute() -> dict:
    d = _Tagged(a=1)
    d.note = "lost by a plain dict copy"
    return d


@pytest.mark.parametrize(("value", "where", "what"), [
    ({"d": collections.defaultdict(lambda: 0)}, "client_state['d']", "default_factory"),
    ({"d": _with_attribute()}, "client_state['d']", "attributes of its own: ['note']"),
    ({"opt": {"fn": len}}, "client_state['opt']['fn']", "a function (len)"),
    ({"a": [1, lambda: 0]}, "client_state['a'][1]", "a function (<lambda>)"),
    ({"cls": dict}, "client_state['cls']", "a class (dict)"),
    ({"arr": np.array([object()])}, "client_state['arr']", "numpy array of dtype object"),
    ({"c": torch.zeros(2, dtype=torch.complex64)}, "client_state['c']", "tensor"),
    ({"lock": __import__("threading").Lock()}, "client_state['lock']", "lock"),
])
def test_unsavable_values_name_their_key(value, where, what):
    with pytest.raises(ValueError) as info:
        encode(value)
    message = str(info.value)
    assert message.startswith(f"{where}: ") and what in message, message


def test_a_load_imports_nothing():
    """A dataclass or enum is rebuilt only from a class already imported (never imported by
    the load); an unknown tag (a newer meshzero) is refused."""
    saved = {TAG: "dataclass", "class": "not_a_module_xyz:Thing", "fields": {}}
    with pytest.raises(ValueError, match="import not_a_module_xyz before loading"):
        decode(saved, {})
    with pytest.raises(ValueError, match="cannot read"):
        decode({TAG: "from_the_future"}, {})


def test_clone_tensors_for_torch_save():
    """deepspeed/checkpoint/utils.py ``clone_tensors_for_torch_save``: every tensor in
    lists, tuples and dicts detached and copied (``clone`` on its device, ``to`` another),
    containers keep their type, other values are returned as they are."""
    base = torch.arange(10.0, requires_grad=True)
    view = base[2:4]
    item = collections.OrderedDict(a=[view], b=(base[5:], "s"), c=3)
    out = clone_tensors_for_torch_save(item, device="cpu")
    assert type(out) is collections.OrderedDict and type(out["b"]) is tuple
    assert out["c"] == 3 and out["b"][1] == "s"
    copied = out["a"][0]
    assert torch.equal(copied, view) and not copied.requires_grad
    assert copied.untyped_storage().nbytes() == 2 * 4  # its own storage, not base's
    assert copied.data_ptr() != view.data_ptr()
    assert torch.equal(clone_tensors_for_torch_save(view), view)
