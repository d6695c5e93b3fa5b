"""Resume a job after a server restart (NVFlare 2.9 cannot resume a job itself: its component snapshot is a
no-op and the job stays RUNNING in the job store after a server restart).

Every round the server writes one checkpoint file, atomically, with the global model, the round just finished,
the method and the state of the server components that carry state across rounds (the aggregator's rule state
and last metadata, e.g. FedMLP's learning degrees or FedIRM's global relation matrix; the model selector's best
round and metric; the results recorded so far) plus the best global model. Each site writes its own state
(trainer state, local model) into its own checkpoint folder after every round, with the round it belongs to.

Checkpoints belong to one run: they are kept per NVFlare job id, and the server's file carries the job id and a
fingerprint of the job's configuration (:func:`config_fingerprint`). A job submitted again with ``resume:
"<job id>"`` (``fedpartial-admin resume JOB_ID JOB_FOLDER``, which sets it on both sides) continues THAT run: its
checkpoint must exist, name that job id and have the fingerprint of the submitted configuration, or the job stops
before training with a message saying which of them differs (another run of the same folder, e.g. a later
shorter one, never lends its state). The resumed job writes its own checkpoints under its own job id, so two runs
of one folder, concurrent or not, never share state. ``resume: true`` continues the run of the same job id: the
simulator's (every simulated job is ``simulate_job``; its checkpoints sit in its own workspace unless
``checkpoint_dir`` is set). The resumed job starts from the checkpoint: the server continues at the next round with the checkpointed model and component
state, each site adopts its saved state of the round before the first resumed round (a site keeps its last two
states, as the server may have died after the sites trained a round it never aggregated; no such state gives a
warning and a fresh site state), the schedule (warm-up stages, ramps, EMA) continues
because the round counter does, and ``results.json`` holds the earlier rounds too.

Where: ``checkpoint_dir`` (both sides, the same in the simulator) else ``<workspace root>/fedpartial_checkpoints``;
inside it ``<run_name>/<job id>/server/`` and ``<run_name>/<job id>/<site>/``; ``run_name`` defaults to the
method's name (jobs set it to their folder's name). Files are written with private permissions and read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import zipfile
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_FILE = "checkpoint.pt"


def site_state_file(round_num: int | str) -> str:
    """A site's state after ``round_num`` (``*``: the glob of all of them); a site keeps its last two."""
    return f"site_state_round{round_num}.pt"


ROOT_FOLDER = "fedpartial_checkpoints"


def run_folder(checkpoint_dir: str, workspace_root: str | Path, run_name: str, job_id: str, who: str) -> Path:
    """``<checkpoint_dir or <workspace_root>/fedpartial_checkpoints>/<run_name>/<job_id>/<who>`` (who: 'server' or
    a site)."""
    for part in (run_name, job_id, who):
        if not part or "/" in part or "\\" in part or part in (".", ".."):
            raise ValueError(f"checkpoint: invalid run, job or participant name {part!r}")
    base = Path(checkpoint_dir).expanduser() if checkpoint_dir else Path(workspace_root) / ROOT_FOLDER
    return base / run_name / job_id / who


def resume_source(resume: bool | str, job_id: str) -> str | None:
    """The job id whose checkpoints a job continues: ``resume`` itself when it is a job id, this job's own id for
    ``true`` (the simulator), None when the job does not resume."""
    if isinstance(resume, str) and resume.strip().lower() not in ("", "false", "true"):
        return resume.strip()
    if resume is True or (isinstance(resume, str) and resume.strip().lower() == "true"):
        return job_id
    return None


FINGERPRINT_IGNORES = ("resume", "num_rounds")  # continuing a run, possibly for more rounds, is the same run


def _without(value, keys: tuple[str, ...]):
    if isinstance(value, dict):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_without(v, keys) for v in value]
    return value


def config_fingerprint(config_dir: str | Path) -> str:
    """SHA-256 (first 16 hex digits) of the app's ``config_fed_*.json`` files with every ``resume`` and
    ``num_rounds`` entry left out: the same for a job folder, its resume copy and the same folder run for more
    rounds, different as soon as anything else differs (data, method options, seed, ...). ``"none"`` when the
    folder holds no configuration."""
    files = sorted(Path(config_dir).glob("config_fed_*.json"))
    if not files:
        return "none"
    blob = json.dumps({f.name: _without(json.loads(f.read_text()), FINGERPRINT_IGNORES) for f in files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def to_safe(value):
    """``value`` with numpy arrays / scalars as tensors / python numbers and tuples as lists, so the file loads
    with ``torch.load(weights_only=True)``."""
    if isinstance(value, dict):
        return {k: to_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    return value


def from_safe(value):
    """Tensors inside ``value`` back to (nested) lists: the method metadata travels to the sites as built-in types."""
    if isinstance(value, dict):
        return {k: from_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_safe(v) for v in value]
    if torch.is_tensor(value):
        return value.tolist()
    return value


def write_private(obj, path: Path) -> None:
    """``torch.save`` to a private temporary file beside ``path``, fsync, then rename over it (atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(to_safe(obj), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def verify_archive(path: str | os.PathLike, what: str = "model file") -> None:
    """Check the CRC32 of every entry of the zip archive ``torch.save`` writes (torch's loader does not: a flipped
    bit in a tensor loads as another number). ``ValueError`` of one line naming the file and the first entry that
    does not match; a file that is no zip archive (a legacy pickle) is left to the loader to judge."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(2) != b"PK":
            return
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception as e:  # noqa: BLE001 - zipfile raises BadZipFile, EOFError, OSError, zlib errors
        raise ValueError(f"{what} {path} is damaged (its archive does not read: {type(e).__name__})") from None
    if bad is not None:
        raise ValueError(
            f"{what} {path} is damaged: its entry {bad} does not match the checksum it was saved with (changed on "
            "disk or in a copy); copy the file again from where the run wrote it"
        )


def read_file(path: Path) -> dict | None:
    """The dict saved at ``path`` (its archive's checksums checked first: :func:`verify_archive`); None when there is
    no file; ValueError naming the file when it is unusable."""
    if not path.is_file():
        return None
    verify_archive(path, "checkpoint")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"checkpoint {path} holds a {type(obj).__name__}, not a checkpoint")
    return obj


def server_checkpoint(
    round_num: int,
    total_rounds: int,
    method: str,
    weights: dict,
    meta: dict,
    components: dict,
    best: dict | None,
    best_round: int | None,
    job_id: str = "",
    fingerprint: str = "",
) -> dict:
    """The server's checkpoint after ``round_num`` (0-based) of ``total_rounds``: the global model ``weights`` and
    the method metadata ``meta`` that goes to the sites with it; ``job_id`` / ``fingerprint`` name the run."""
    return {
        "format": 1,
        "round": int(round_num),
        "total_rounds": int(total_rounds),
        "method": method,
        "job_id": job_id,
        "fingerprint": fingerprint,
        "weights": as_tensors(weights),
        "meta": meta,
        "components": components,
        "best": None if best is None else as_tensors(best),
        "best_round": best_round,
    }


def as_tensors(weights: dict) -> dict[str, torch.Tensor]:
    """Model weights (numpy arrays, numpy scalars or tensors) as tensors, 0-d ones included."""
    return {k: v if torch.is_tensor(v) else torch.as_tensor(np.asarray(v)) for k, v in weights.items()}


def check_resume(
    ckpt: dict | None,
    where: Path,
    method: str,
    total_rounds: int,
    weights: dict,
    job_id: str | None = None,
    fingerprint: str | None = None,
) -> str | None:
    """Why the checkpoint cannot continue this job (None: it can). ``weights``: the job's initial global model;
    ``job_id`` / ``fingerprint``: the run to continue and this job's configuration fingerprint (None: unchecked)."""
    if ckpt is None:
        return (
            f"resume: no checkpoint of job {job_id} in {where} (a job id that never ran this job folder here, or "
            "a run without checkpoints)"
        )
    if ckpt.get("format") != 1 or "round" not in ckpt or "weights" not in ckpt:
        return f"resume: {where / CHECKPOINT_FILE} is not a checkpoint of this version"
    if job_id is not None and ckpt.get("job_id") != job_id:
        return (
            f"resume: the checkpoint in {where} belongs to job {ckpt.get('job_id')!r}, not to job {job_id!r}: "
            "refusing to continue a run from another run's state"
        )
    if fingerprint is not None and ckpt.get("fingerprint") != fingerprint:
        return (
            f"resume: job {job_id} ran another configuration (fingerprint {ckpt.get('fingerprint')}, the "
            f"submitted job folder's is {fingerprint}): resume it with the job folder it was submitted with"
        )
    if ckpt.get("method") != method:
        return f"resume: the checkpoint is of method {ckpt.get('method')!r}, the job runs {method!r}"
    if int(ckpt["round"]) + 1 > total_rounds:
        return (
            f"resume: the checkpoint is after round {ckpt['round']} but the job has only {total_rounds} round(s) "
            "(num_rounds counts all rounds, the earlier ones included)"
        )
    saved = ckpt["weights"]
    if set(saved) != set(weights):
        diff = sorted(set(saved) ^ set(weights))[:3]
        return f"resume: the checkpoint's model differs from the job's (tensors {diff})"
    bad = [k for k in weights if tuple(saved[k].shape) != tuple(np.shape(weights[k]))]
    if bad:
        return f"resume: tensor shapes differ from the job's model ({bad[:3]})"
    return None
