"""Putting a checkpoint directory back in order after a save was killed.

A save writes ``.tmp-{tag}``; a re-save of an existing tag swaps it with the committed copy
in one atomic step (format.commit_tag, Linux's ``renameat2(RENAME_EXCHANGE)``), so ``tag``
is never missing and the old copy, now ``.tmp-{tag}``, is removed last. Where the file
system cannot swap, the committed copy is moved to ``.old-{tag}`` just before the new one is
renamed into place, and a kill between those two renames leaves ``tag`` missing and
``latest`` perhaps naming it. The rule, applied by world rank 0 at the start of every save
and load (:func:`recover_tags`)::

    tag missing, .tmp-{tag} complete   -> rename it to tag       (roll forward)
    tag missing, .old-{tag} complete   -> rename it to tag       (roll back)
    then                               -> remove .tmp-{tag} and .old-{tag}

A tag directory is complete when its manifests read (checksum included) and every file they
list is there with its size: each file was fsynced before the manifest that lists it was
written, and the manifest is written last. ``consolidate`` only reads: it takes the copy
:func:`readable_tag` finds, the same one recovery would keep.
"""

from __future__ import annotations

import logging
from pathlib import Path

from meshzero.checkpoint.atomic import TEMP_SUFFIX, fsync_dir, remove_tree, rename
from meshzero.checkpoint.format import old_dir, read_manifest, tmp_dir

logger = logging.getLogger(__name__)

_PREFIXES = (".tmp-", ".old-")


def tag_complete(directory: Path) -> bool:
    """Whether ``directory`` holds a whole tag: manifests valid, every listed file present
    with the size the manifest gives."""
    try:
        top = read_manifest(directory)
        pieces = [directory / name for name in top.get("pieces", [])]
        manifests = [(directory, top)] + [(p, read_manifest(p)) for p in pieces]
        for where, manifest in manifests:
            for entry in manifest["files"]:
                path = where / entry["name"]
                if not path.is_file() or path.stat().st_size != entry["bytes"]:
                    return False
    except (ValueError, OSError, TypeError, KeyError):
        return False
    return True


def readable_tag(save_dir: Path, tag: str) -> Path:
    """The directory that holds ``tag``: itself, else the complete copy recovery would
    rename to it (read-only)."""
    final = save_dir / tag
    if final.is_dir():
        return final
    for candidate in (tmp_dir(save_dir, tag), old_dir(save_dir, tag)):
        if candidate.is_dir() and tag_complete(candidate):
            return candidate
    return final


def recover_tags(save_dir: Path) -> list[str]:
    """Finish or undo every interrupted commit under ``save_dir`` (rule above); returns the
    tags put back. Call on one rank, with no save running."""
    if not save_dir.is_dir():
        return []
    leftovers = sorted({entry.name[len(prefix):] for entry in save_dir.iterdir()
                        for prefix in _PREFIXES
                        if entry.name.startswith(prefix) and entry.is_dir()})
    restored = []
    for tag in leftovers:
        final = save_dir / tag
        if not final.exists():
            source = readable_tag(save_dir, tag)
            if source != final:
                rename(source, final)
                fsync_dir(save_dir)
                restored.append(tag)
                logger.warning("checkpoint %s was missing after an interrupted save: restored "
                               "it from %s", final, source.name)
        remove_tree(tmp_dir(save_dir, tag))
        remove_tree(old_dir(save_dir, tag))
    for entry in save_dir.iterdir():  # an interrupted write of 'latest'
        if entry.name.endswith(TEMP_SUFFIX) and entry.is_file():
            remove_tree(entry)
    if leftovers:
        fsync_dir(save_dir)
    return restored

