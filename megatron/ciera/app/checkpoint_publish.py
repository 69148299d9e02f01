"""Publishing a checkpoint folder atomically, with checksums, and finding and verifying published ones.

Layout, as Megatron-LM writes it::

    <root>/latest_checkpointed_iteration.txt      the tracker: written last, atomically
    <root>/iter_0000010/                           the checkpoint's files
        checksums.sha256                           (CIERA-Megatron) ``sha256sum -c`` format

A save writes into ``iter_N.incomplete/`` (:func:`begin`); :func:`publish` then writes the
checksums, renames the folder to ``iter_N`` and only then replaces the tracker, each step durable
before the next: a crash at any point leaves the previous checkpoint the latest, and no
half-written folder is ever read. :func:`verify` hashes a loaded folder's files, shared out over
the ranks, and agrees on the verdict. Every function taking a folder to write or verify is
collective.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil

import torch.distributed as dist

from megatron.ciera.app import torch_checkpoint

__all__ = ["TRACKER", "CHECKSUMS", "INCOMPLETE", "print0", "iteration_dir", "latest_iteration", "complete_iterations",
           "begin", "remove_interrupted", "write_checksums", "publish", "retire", "verify"]

TRACKER = "latest_checkpointed_iteration.txt"
CHECKSUMS = "checksums.sha256"
INCOMPLETE = ".incomplete"
RETIRED = ".retired"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


def print0(msg: str) -> None:
    """Print ``msg`` on rank 0 only (the checkpoint notes and warnings)."""
    if dist.get_rank() == 0:
        print(msg, flush=True)


def iteration_dir(root: str, iteration: int) -> str:
    """The folder of checkpoint ``iteration`` under ``root`` (``iter_0000010``)."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """The tracker's iteration, ``None`` when there is no tracker."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            text = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not text.isdigit():
        raise SystemExit(f"{os.path.join(root, TRACKER)}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def complete_iterations(root: str) -> list[int]:
    """Iterations of the finished checkpoint folders under ``root`` (ascending)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, names) if m)


def begin(*, root: str, iteration: int) -> str:
    """Collective: an empty ``iter_N.incomplete`` folder under ``root`` for checkpoint ``iteration``
    (one left by an interrupted save is replaced); returns its path."""
    partial = iteration_dir(root, iteration) + INCOMPLETE
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    return partial


def remove_interrupted(root: str) -> None:
    """Collective: what interrupted saves and removals left under ``root`` (``iter_N.incomplete``
    folders and their writers' marks, ``iter_N.retired`` folders) is removed (by rank 0, each named)."""
    if dist.get_rank() == 0:
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.startswith("iter_") and (name.endswith(INCOMPLETE) or name.endswith(RETIRED)):
                why = "an interrupted save" if name.endswith(INCOMPLETE) else "an interrupted removal"
                print(f"removing {path} ({why})", flush=True)
                shutil.rmtree(path, ignore_errors=True)
            elif name.startswith("iter_") and INCOMPLETE + "." in name and os.path.isfile(path):
                os.remove(path)  # a background writer's mark (megatron.ciera.app.checkpoint_async)
    dist.barrier()


def retire(*, root: str, iteration: int, previous: int | None, retain_interval: int | None,
           protect: str | None = None) -> None:
    """``--save-retain-interval``, as Megatron-LM: once checkpoint ``iteration`` is the latest, the
    one the tracker named before it (``previous``) is removed unless its iteration is a multiple
    of ``retain_interval``, or it is a symbolic link, or it is ``protect`` (the checkpoint this run
    loaded), or it is ``iteration`` itself. Rank 0 renames it to ``iter_N.retired`` first (an
    interrupted removal never leaves a half folder that looks complete)."""
    if (dist.get_rank() != 0 or retain_interval is None or not previous or previous == iteration
            or previous % retain_interval == 0):
        return
    folder = iteration_dir(root, previous)
    if os.path.islink(folder) or not os.path.isdir(folder):
        return
    if protect is not None and os.path.realpath(folder) == os.path.realpath(protect):
        print(f"keeping {folder}: this run loaded it (--save-retain-interval {retain_interval})", flush=True)
        return
    retired = folder + RETIRED
    os.replace(folder, retired)
    shutil.rmtree(retired, ignore_errors=True)
    print(f"removed {folder} (--save-retain-interval {retain_interval}: {previous} is not a multiple)", flush=True)


def _files(folder: str) -> list[str]:
    out = []
    for base, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(base, n), folder) for n in names if n != CHECKSUMS]
    return sorted(out)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _hash_share(folder: str, names: list[str]) -> dict:
    """This rank's share (every world-th file) of the digests; ``None`` for an unreadable file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names[rank::world]:
        try:
            out[name] = _sha256(os.path.join(folder, name))
        except OSError:
            out[name] = None
    return out


def write_checksums(folder: str) -> None:
    """Collective: the digests of every file in ``folder``, hashed in parallel, written by rank 0."""
    names = _files(folder)
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, _hash_share(folder, names))
    if dist.get_rank() == 0:
        digests = {k: v for share in shares for k, v in share.items()}
        tmp = os.path.join(folder, CHECKSUMS + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(f"{digests[n]}  {n}\n" for n in names)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, CHECKSUMS))


def verify(folder: str) -> list[str]:
    """Collective: what is wrong with checkpoint ``folder`` ([] when it passes), the same list on
    every rank. A checkpoint without a checksums file (written by Megatron-LM) passes unverified."""
    listing = os.path.join(folder, CHECKSUMS)
    problems = []
    if not os.path.isdir(folder):
        problems.append(f"{folder} does not exist")
    elif not (os.path.isfile(os.path.join(folder, "metadata.json")) or torch_checkpoint.is_torch_checkpoint(folder)
              or os.path.isfile(os.path.join(folder, ".metadata"))):  # (.metadata alone: fsdp_dtensor)
        problems.append(f"{os.path.join(folder, 'metadata.json')} is missing (not a complete torch_dist checkpoint, "
                        f"nor a torch one with mp_rank_*/{torch_checkpoint.MODEL_FILE}, nor an fsdp_dtensor one "
                        "with .metadata)")
    elif os.path.isfile(listing):
        with open(listing) as f:
            expected = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f if line.strip())
        names = sorted(expected)
        mine = _hash_share(folder, names)
        for name, digest in mine.items():
            path = os.path.join(folder, name)
            if digest is None:
                problems.append(f"{path} is missing or unreadable")
            elif digest != expected[name]:
                problems.append(f"{path} is damaged (sha256 {digest[:16]}..., expected {expected[name][:16]}...)")
    else:
        print0(f"note: {folder} has no {CHECKSUMS} (not written by CIERA-Megatron): loading it unverified")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return sorted({p for ps in everyone for p in ps})


def publish(*, root: str, iteration: int, retain_interval: int | None = None, protect: str | None = None) -> None:
    """Collective, once every rank's files of ``iter_N.incomplete`` are written: checksums, then
    the rename to ``iter_N``, then the tracker (each step only after the one before is durable),
    then, with ``retain_interval``, the removal of the previous latest (:func:`retire`)."""
    final = iteration_dir(root, iteration)
    partial = final + INCOMPLETE
    dist.barrier()
    write_checksums(partial)
    if dist.get_rank() == 0:
        previous = latest_iteration(root)
        replaced = final + ".replaced"
        if os.path.exists(final):  # re-saving an iteration: the old folder goes only once the new one is whole
            os.replace(final, replaced)
        os.replace(partial, final)
        shutil.rmtree(replaced, ignore_errors=True)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, TRACKER))
        retire(root=root, iteration=iteration, previous=previous, retain_interval=retain_interval, protect=protect)
    dist.barrier()
