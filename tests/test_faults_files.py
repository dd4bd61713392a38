"""Faults while meshzero writes files: kill points, a full disk, damaged and mismatched input.

Kill points: a save runs in a spawned process whose file-system hook (checkpoint.atomic.
set_fault_hook) counts the steps (write, data, fsync, fsync-dir, mkdir, rename, remove) and
SIGKILLs the process before step k. A dry run lists the steps; the default set kills at a
few chosen ones, the slow set before every one. After each kill the previous or the new
version loads whole (never a mix), ``latest`` names a complete tag, and a resume is
bit-identical to a run that was never interrupted.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from meshzero import checkpoint
from meshzero.checkpoint import atomic
from meshzero.checkpoint.model_files import resolve_weight_files
from meshzero.checkpoint.tags import tag_complete
from meshzero.cli import main
from tests.distributed import DistributedTestError, run_distributed
from tests.test_checkpoint import fp32_config, make_engine, train_steps

END = 4  # steps of the reference run; a resume trains from the loaded step to END
TAG = "last"


def _kill_at(step: int | None, record: list | None = None, root: Path | None = None):
    """A hook that SIGKILLs this process before file-system step ``step`` (counted from 0)
    and records ``(kind, path relative to root)`` of every step."""
    count = [0]

    def hook(kind: str, path: Path) -> None:
        if record is not None:
            record.append((kind, os.path.relpath(path, root) if root else path.name))
        if count[0] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1

    return hook


def _no_space_at(kind: str, name: str):
    """A hook that fails step ``kind`` of file ``name`` as a full disk does."""

    def hook(step_kind: str, path: Path) -> None:
        if step_kind == kind and path.name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return hook


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*")
                  if p.name.startswith((".tmp-", ".old-")) or p.name.endswith(
                      (atomic.TEMP_SUFFIX, atomic.JOURNAL)))


# -- re-saving a tag -------------------------------------------------------------------------
def _reference(rank: int, world_size: int) -> dict:
    engine = make_engine(fp32_config(2))
    losses = train_steps(engine, rank, world_size, range(END))
    return dict(losses=losses, params=engine.full_state_dict())


def _resave(rank: int, world_size: int, root: str, kill_step: int | None, kill_rank: int = 0
            ) -> list:
    """Save tag 'last' after step 1, then re-save it after step 2, ``kill_rank`` killed at
    ``kill_step``; returns the steps of ``kill_rank``."""
    engine = make_engine(fp32_config(2))
    train_steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(root, tag=TAG, client_state={"saved_at": 1})
    train_steps(engine, rank, world_size, range(1, 2))
    steps: list = []
    if rank == kill_rank:
        atomic.set_fault_hook(_kill_at(kill_step, steps, Path(root)))
    engine.save_checkpoint(root, tag=TAG, client_state={"saved_at": 2})
    atomic.set_fault_hook(None)
    return steps


def _resume_each(rank: int, world_size: int, roots: list[str]) -> list[dict]:
    """Resume from each root; first, a copy of it gets a save of another tag (without a
    load before), which must put 'last' back as a load does."""
    out = []
    for root in roots:
        if rank == 0:
            shutil.copytree(root, f"{root}-saved")
        if world_size > 1:
            dist.barrier()
        make_engine(fp32_config(2), seed=1).save_checkpoint(f"{root}-saved", tag="other")
        engine = make_engine(fp32_config(2), seed=1)
        _, client_state = engine.load_checkpoint(root)
        start = engine.global_steps
        losses = train_steps(engine, rank, world_size, range(start, END))
        out.append(dict(start=start, client_state=client_state, losses=losses,
                        params=engine.full_state_dict()))
    return out


@pytest.fixture(scope="module")
def resave(tmp_path_factory) -> dict:
    """The reference run and the steps of a re-save of 'last' (dry run, no kill)."""
    tmp = tmp_path_factory.mktemp("resave")
    (steps,) = run_distributed(_resave, 1, tmp, str(tmp / "ckpt"), None)
    (reference,) = run_distributed(_reference, 1, tmp)
    return dict(steps=[tuple(s) for s in steps], reference=reference)


def _check_resave_kills(resave: dict, tmp_path: Path, points: list[int], world_size: int = 1,
                        kill_rank: int = 0) -> None:
    steps, reference = resave["steps"], resave["reference"]
    # the new copy takes the tag's place here (one swap); a kill after it keeps the new copy
    swap = ("exchange", TAG)
    moved = steps.index(swap) if swap in steps else len(steps)
    roots = []
    for k in points:
        root = tmp_path / f"kill{k}"
        with pytest.raises(DistributedTestError, match="exited with code -9"):
            run_distributed(_resave, world_size, tmp_path, str(root), k, kill_rank)
        roots.append(str(root))
        # before any recovery: 'latest' names a complete tag, the one a resume loads
        latest = (root / "latest").read_text()
        assert latest == TAG and tag_complete(root / latest), f"killed before step {k}"
    results = run_distributed(_resume_each, world_size, tmp_path, roots)[0]
    for k, root, got in zip(points, roots, results, strict=True):
        where = f"killed before step {k} {steps[k]}"
        want = 2 if k > moved else 1
        assert (got["start"], got["client_state"]) == (want, {"saved_at": want}), where
        assert got["losses"] == reference["losses"][want:], where
        for name, value in reference["params"].items():
            assert torch.equal(got["params"][name], value), (where, name)
        assert (Path(root) / "latest").read_text() == TAG, where
        assert tag_complete(Path(root) / TAG), where
        assert _leftovers(Path(root)) == [], where
        saved = Path(f"{root}-saved")
        assert (saved / "latest").read_text() == "other", where
        assert tag_complete(saved / TAG) and _leftovers(saved) == [], where


def test_resave_steps_are_the_documented_protocol(resave):
    kinds = [s for s in resave["steps"] if s[0] in ("rename", "exchange", "remove", "mkdir")]
    assert kinds[0] == ("mkdir", f".tmp-{TAG}")
    moves = [(kind, path) for kind, path in kinds if kind in ("rename", "exchange")]
    # the new copy and the old swap places in one step; the old (now .tmp-) is removed last
    assert moves == [("exchange", TAG), ("rename", "latest")], moves
    assert kinds[-1] == ("remove", f".tmp-{TAG}")
    steps = resave["steps"]
    manifest = steps.index(("write", f".tmp-{TAG}/manifest.json"))
    assert steps[manifest - 1] == ("fsync-dir", f".tmp-{TAG}")  # the rank files' entries
    for name in ("rank00000.safetensors", "shared.safetensors"):  # each file fsynced before
        assert steps.index(("fsync", f".tmp-{TAG}/{name}")) < manifest
    # the temporary tag directory is fsynced before the swap
    assert steps[steps.index(("exchange", TAG)) - 1] == ("fsync-dir", f".tmp-{TAG}")


def test_killed_resave_of_a_tag_resumes_bit_identically(resave, tmp_path):
    steps = resave["steps"]
    points = [steps.index(("exchange", TAG)),  # the old tag and a complete .tmp-
              steps.index(("rename", "latest")),  # the new tag, the old one in .tmp-
              steps.index(("remove", f".tmp-{TAG}"))]
    _check_resave_kills(resave, tmp_path, points)


def _latest_at_every_step(rank: int, world_size: int, root: str) -> list:
    """Re-save 'last' (latest naming it), then save 'other' and re-save 'last' again
    (latest naming 'other'); before every file-system step of the re-saves and after the
    last one: (step, the tag latest names, whether that tag is complete)."""
    engine = make_engine(fp32_config(2))
    seen: list = []

    def look(kind: str, path: Path) -> None:
        latest = (Path(root) / "latest").read_text()
        seen.append((f"{kind} {path.name}", latest, tag_complete(Path(root) / latest)))

    for i, tag in enumerate((TAG, TAG, "other", TAG)):
        train_steps(engine, rank, world_size, range(i, i + 1))
        atomic.set_fault_hook(look if i in (1, 3) else None)
        engine.save_checkpoint(root, tag=tag)
        atomic.set_fault_hook(None)
        look("end", Path(root))
    return seen


def test_latest_names_a_complete_tag_at_every_step_of_a_resave(tmp_path):
    (seen,) = run_distributed(_latest_at_every_step, 1, tmp_path, str(tmp_path / "ck"))
    assert len(seen) > 40 and {latest for _, latest, _ in seen} == {TAG, "other"}
    assert [step for step, _, complete in seen if not complete] == []


@pytest.mark.slow
def test_killed_resave_at_every_step(resave, tmp_path):
    _check_resave_kills(resave, tmp_path, list(range(len(resave["steps"]))))


@pytest.mark.slow
def test_killed_resave_on_rank1_at_every_step(tmp_path):
    """Two ranks; rank 1 dies before each of its steps (its files): the old tag stays."""
    steps = run_distributed(_resave, 2, tmp_path, str(tmp_path / "dry"), None, 1)[1]
    reference = run_distributed(_reference, 2, tmp_path)[0]
    resave = dict(steps=[tuple(s) for s in steps], reference=reference)
    assert [kind for kind, _ in resave["steps"]] == ["write", "data", "fsync", "write", "fsync"]
    _check_resave_kills(resave, tmp_path, list(range(len(steps))), world_size=2, kill_rank=1)


def test_recovery_rules(models, tmp_path):
    """tags.recover_tags on hand-made leftovers: roll forward, roll back, clean up."""
    from meshzero.checkpoint.format import resolve_tag
    from meshzero.checkpoint.tags import readable_tag, recover_tags

    def case(name: str, parts: dict[str, str | None]) -> Path:
        """``parts``: directory -> the saved tag copied there (None: an incomplete copy)."""
        root = tmp_path / name
        root.mkdir()
        for where, source in parts.items():
            shutil.copytree(models["root"] / "ckpt" / (source or "v1"), root / where)
            if source is None:
                (root / where / "manifest.json").unlink()
        (root / "latest").write_text(TAG)
        return root

    def holds(directory: Path) -> str:
        return json.loads((directory / "manifest.json").read_text())["tag"]

    forward = case("forward", {f".tmp-{TAG}": "v2", f".old-{TAG}": "v1"})
    back = case("back", {f".tmp-{TAG}": None, f".old-{TAG}": "v1"})
    clean = case("clean", {TAG: "v2", f".tmp-{TAG}": "v1", f".old-{TAG}": "v1"})
    lost = case("lost", {f".tmp-{TAG}": None})
    assert readable_tag(forward, TAG) == forward / f".tmp-{TAG}"  # what consolidate reads
    assert readable_tag(back, TAG) == back / f".old-{TAG}"
    assert recover_tags(forward) == recover_tags(back) == [TAG]
    assert recover_tags(clean) == recover_tags(lost) == []
    assert [holds(r / TAG) for r in (forward, back, clean)] == ["v2", "v1", "v2"]
    for root in (forward, back, clean, lost):
        assert _leftovers(root) == [], root
    with pytest.raises(ValueError, match=f"{lost / 'latest'} names tag 'last', but"):
        resolve_tag(lost, None)


# -- whole-model files -----------------------------------------------------------------------
def _two_models(rank: int, world_size: int, root: str, kill_step: int | None) -> dict:
    """save_16bit_model after step 1, consolidate of that tag into a sharded set, then both
    again from step 2 (killed at ``kill_step`` of the 16-bit save when given)."""
    engine = make_engine(fp32_config(2))
    versions = []
    for step in (1, 2):
        train_steps(engine, rank, world_size, range(step - 1, step))
        if step == 2 and kill_step is not None:
            atomic.set_fault_hook(_kill_at(kill_step))
        steps: list = []
        if step == 2 and kill_step is None:
            atomic.set_fault_hook(_kill_at(None, steps, Path(root) / "m16"))
        engine.save_16bit_model(f"{root}/m16")
        atomic.set_fault_hook(None)
        engine.save_checkpoint(f"{root}/ckpt", tag=f"v{step}")
        versions.append(engine.full_state_dict())
    return dict(versions=versions, steps=steps)


def _consolidate(rank: int, world_size: int, root: str, out: str, kill_step: int | None
                 ) -> list:
    """Consolidate v1 in 2 KB shards, then v2 over it in 3 KB shards (fewer: the extra old
    shards must go), killed at ``kill_step`` of the second."""
    checkpoint.consolidate(f"{root}/ckpt", out, tag="v1", max_shard_size="2KB")
    steps: list = []
    atomic.set_fault_hook(_kill_at(kill_step, steps, Path(out)))
    checkpoint.consolidate(f"{root}/ckpt", out, tag="v2", max_shard_size="3KB", overwrite=True)
    atomic.set_fault_hook(None)
    return steps


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    (run,) = run_distributed(_two_models, 1, root, str(root), None)
    (steps,) = run_distributed(_consolidate, 1, root, str(root), str(root / "out"), None)
    return dict(root=root, versions=run["versions"], steps16=run["steps"], steps=steps)


def _loads_as_one_version(directory: Path, versions: list[dict], where: str) -> int:
    """Which version the model files in ``directory`` hold, whole (never a mix)."""
    state: dict = {}
    for file in set(resolve_weight_files(directory).values()):  # finishes a journal
        state.update(load_file(file))
    matches = [i for i, v in enumerate(versions) if v.keys() == state.keys()
               and all(torch.equal(v[n], state[n]) for n in v)]
    assert len(matches) == 1, f"{where}: the files hold no single version"
    # temporaries of a write killed before its commit stay until the next write
    assert not (directory / atomic.JOURNAL).exists(), where
    return matches[0]


def _check_model_kills(models: dict, tmp_path: Path, points: list[int], which: str) -> None:
    root, versions = models["root"], models["versions"]
    steps = models["steps16"] if which == "16bit" else models["steps"]
    journal = steps.index(("rename", atomic.JOURNAL))  # the new set is committed here
    for k in points:
        where = f"{which} killed before step {k} {steps[k]}"
        case = tmp_path / f"{which}{k}"
        if which == "16bit":
            with pytest.raises(DistributedTestError, match="exited with code -9"):
                run_distributed(_two_models, 1, tmp_path, str(case), k)
            got = _loads_as_one_version(case / "m16", versions, where)
        else:
            shutil.copytree(root / "ckpt", case / "ckpt")
            with pytest.raises(DistributedTestError, match="exited with code -9"):
                run_distributed(_consolidate, 1, tmp_path, str(case), str(case / "out"), k)
            got = _loads_as_one_version(case / "out", versions, where)
            checkpoint.consolidate(case / "ckpt", case / "out", tag="v1", overwrite=True)
            assert _loads_as_one_version(case / "out", versions, where) == 0
            assert _leftovers(case / "out") == [], f"the next write cleans up; {where}"
        assert got == (1 if k > journal else 0), where


def test_killed_16bit_save_and_consolidate_leave_one_whole_model(models, tmp_path):
    steps = models["steps"]  # a truncated first shard; between the renames of two shards
    journal = steps.index(("rename", atomic.JOURNAL))
    assert steps[journal + 2][0] == steps[journal + 3][0] == "rename"
    _check_model_kills(models, tmp_path, [1, journal + 3], "consolidate")
    steps = models["steps16"]  # a truncated file; the journal committed, nothing renamed
    journal = steps.index(("rename", atomic.JOURNAL))
    assert steps[1] == ("data", "model.safetensors")
    assert steps[journal + 2] == ("rename", "model.safetensors")
    _check_model_kills(models, tmp_path, [1, journal + 2], "16bit")


@pytest.mark.slow
def test_killed_consolidate_at_every_step(models, tmp_path):
    _check_model_kills(models, tmp_path, list(range(len(models["steps"]))), "consolidate")


@pytest.mark.slow
def test_killed_16bit_save_at_every_step(models, tmp_path):
    _check_model_kills(models, tmp_path, list(range(len(models["steps16"]))), "16bit")


# -- a full disk, different tags, a truncated weights file -----------------------------------
def _faults(rank: int, world_size: int, root: str) -> dict:
    engine = make_engine(fp32_config(2))
    train_steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(f"{root}/ckpt", tag=TAG, client_state={"saved_at": 1})
    engine.save_16bit_model(f"{root}/m16")
    want = engine.full_state_dict()
    train_steps(engine, rank, world_size, range(1, 2))
    errors = {}
    calls = {  # name: (call, the rank whose disk is full, the file it fills)
        "checkpoint": (lambda: engine.save_checkpoint(f"{root}/ckpt", tag=TAG), 1,
                       "rank00001.safetensors"),
        "16bit": (lambda: engine.save_16bit_model(f"{root}/m16"), 0, "model.safetensors"),
        "tags": (lambda: engine.save_checkpoint(f"{root}/ckpt", tag=f"t{rank}"), None, ""),
    }
    for name, (call, full, file) in calls.items():
        atomic.set_fault_hook(_no_space_at("data", file) if rank == full else None)
        with pytest.raises((OSError, ValueError, RuntimeError)) as info:
            call()
        atomic.set_fault_hook(None)
        errors[name] = str(info.value)
    after_full_disk = sorted(p.name for p in (Path(root) / "m16").iterdir())
    if rank == 0:
        data = (Path(root) / "m16" / "model.safetensors").read_bytes()
        (Path(root) / "cut").mkdir()
        (Path(root) / "cut" / "model.safetensors").write_bytes(data[:-100])
    dist.barrier()
    with pytest.raises(ValueError) as info:
        engine.load_weights(f"{root}/cut/model.safetensors")
    errors["truncated"] = str(info.value)
    _, client_state = engine.load_checkpoint(f"{root}/ckpt")  # the earlier versions load
    restored = engine.full_state_dict()
    engine.load_weights(f"{root}/m16")
    weights = engine.full_state_dict()
    # a 16-bit save that fails once its journal is committed: load_weights rolls it forward
    train_steps(engine, rank, world_size, range(1, 2))
    atomic.set_fault_hook(_no_space_at("rename", "model.safetensors") if rank == 0 else None)
    with pytest.raises((OSError, RuntimeError)):
        engine.save_16bit_model(f"{root}/m16")
    atomic.set_fault_hook(None)
    newer = engine.full_state_dict()
    journal = (Path(root) / "m16" / atomic.JOURNAL).exists()
    engine.load_checkpoint(f"{root}/ckpt")
    engine.load_weights(f"{root}/m16")
    return dict(errors=errors, client_state=client_state, restored=restored, want=want,
                weights=weights, newer=newer, journal=journal, after_full_disk=after_full_disk,
                rolled_forward=engine.full_state_dict())


def test_full_disk_different_tags_and_a_truncated_file_name_the_file(tmp_path):
    results = run_distributed(_faults, 2, tmp_path, str(tmp_path))
    ckpt, m16 = tmp_path / "ckpt", tmp_path / "m16"
    first, second = results[0]["errors"], results[1]["errors"]
    full = "No space left on device (errno 28 ENOSPC)"
    assert f"cannot write {ckpt / f'.tmp-{TAG}' / 'rank00001.safetensors'}: {full}" == \
        second["checkpoint"]
    assert "failed on 1 other rank" in first["checkpoint"]
    assert first["16bit"] == f"cannot write {m16 / 'model.safetensors'}: {full}"
    for errors in (first, second):
        assert "the ranks pass different tags ('t0' on rank(s) [0]; 't1' on rank(s) [1])" in \
            errors["tags"]
        assert errors["truncated"].startswith(
            f"weights file {tmp_path / 'cut' / 'model.safetensors'} is truncated")
    # the failed saves left the earlier versions whole, and no temporary
    assert sorted(p.name for p in ckpt.iterdir()) == [TAG, "latest"]
    assert results[0]["after_full_disk"] == ["model.safetensors"]
    for r in results:
        assert r["client_state"] == {"saved_at": 1}
        for name, value in r["want"].items():
            assert torch.equal(r["restored"][name], value), name
            assert torch.equal(r["weights"][name], value), name
            assert torch.equal(r["rolled_forward"][name], r["newer"][name]), name
        assert any(not torch.equal(v, r["newer"][n]) for n, v in r["want"].items())
    assert results[0]["journal"]
    assert sorted(p.name for p in m16.iterdir()) == ["model.safetensors"]


# -- manifests and the consolidate command ---------------------------------------------------
def _cli_error(args: list[str], capsys) -> str:
    assert main(["consolidate", *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshzero consolidate: error: "), err
    return err


def test_damaged_manifests_are_one_line_errors_naming_the_file(models, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(models["root"] / "ckpt", ckpt)
    path = ckpt / "v1" / "manifest.json"
    good = json.loads(path.read_text())
    assert good["manifest_sha256"] == checkpoint.format.manifest_checksum(good)
    name, info = next(iter(good["params"].items()))
    shrunk = dict(good, params={**good["params"], name: {**info, "shape": [
        info["shape"][0] - 1, *info["shape"][1:]]}})
    no_checksum = {k: v for k, v in shrunk.items() if k != "manifest_sha256"}
    for manifest, why in [
        ({k: v for k, v in good.items() if k != "state_dict"}, "lacks 'state_dict'"),
        ({**good, "optimizer": {"class": "x"}}, "lacks 'optimizer.param_groups'"),
        (shrunk, "fails its own checksum"),
        (no_checksum, f"parameter {name!r} has shape"),  # an older manifest, shapes checked
    ]:
        path.write_text(json.dumps(manifest))
        err = _cli_error([str(ckpt), str(out), "--tag", "v1"], capsys)
        assert f"{path}" in err and why in err, err
        assert not out.exists()


def test_consolidate_onto_an_existing_model_needs_overwrite(models, tmp_path, capsys):
    ckpt, out = models["root"] / "ckpt", tmp_path / "out"
    assert main(["consolidate", str(ckpt), str(out), "--tag", "v1"]) == 0
    capsys.readouterr()
    err = _cli_error([str(ckpt), str(out), "--tag", "v2"], capsys)
    assert f"{out / 'model.safetensors'} already exists; pass --overwrite" in err
    assert main(["consolidate", str(ckpt), str(out), "--tag", "v2", "--overwrite"]) == 0
    state = load_file(out / "model.safetensors")
    for name, value in models["versions"][1].items():
        assert torch.equal(state[name], value), name
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    (tmp_path / "file").write_text("x")
    assert "is a file" in _cli_error([str(ckpt), str(tmp_path / "file")], capsys)


# -- a real full disk ------------------------------------------------------------------------
def _fill(rank: int, world_size: int, root: str) -> dict:
    engine = make_engine(fp32_config(2))
    train_steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(root, tag=TAG, client_state={"saved_at": 1})
    train_steps(engine, rank, world_size, range(1, 2))
    try:
        engine.save_checkpoint(root, tag=TAG, client_state={"saved_at": 2})
        error = ""
    except OSError as exc:
        error = str(exc)
    _, client_state = make_engine(fp32_config(2), seed=1).load_checkpoint(root)
    return dict(error=error, client_state=client_state)


@pytest.mark.slow
def test_real_full_disk_on_a_small_tmpfs(tmp_path):
    (run,) = run_distributed(_fill, 1, tmp_path, str(tmp_path / "measure"))
    size = sum(p.stat().st_size for p in (tmp_path / "measure" / TAG).iterdir())
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    limit = (size * 3 // 2 + 8191) // 4096 * 4096  # the first save fits, not a second beside it
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(mnt)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        (run,) = run_distributed(_fill, 1, tmp_path, str(mnt / "ckpt"))
        assert "No space left on device (errno 28 ENOSPC)" in run["error"], run["error"]
        assert f"cannot write {mnt / 'ckpt' / f'.tmp-{TAG}'}" in run["error"]
        assert run["client_state"] == {"saved_at": 1}
        assert sorted(p.name for p in (mnt / "ckpt").iterdir()) == [TAG, "latest"]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
