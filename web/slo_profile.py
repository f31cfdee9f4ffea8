"""``--slo-profile PATH``: the latency model saved across restarts (issue
#44; docs/reliability.md, "Latency objectives").

At start, a profile at PATH seeds the engine's latency model
(``LatencyModel.from_profile``), so that SLO admission predicts from the
first request as the last run ended instead of from the prior; one learned
for another model or other settings (``profile_identity``) is set aside
with a warning, and the model starts fresh. At the server's stop
(SIGTERM included), after the drain, the model is written back to PATH,
through a temporary file renamed over it, so a crash mid-write leaves the
old profile whole.

With ``--data-parallel-size N`` each replica learns its own model, and
keeps its own profile: replica ``i`` uses ``PATH.i`` (``replica_paths``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from trioserve.engine.core.latency_model import LatencyModel, LatencyProfileError

log = logging.getLogger(__name__)


def replica_paths(path: str, num_replicas: int) -> list[str]:
    """The profile path of each replica: PATH itself for one, ``PATH.i`` for several."""
    if num_replicas == 1:
        return [path]
    return [f"{path}.{index}" for index in range(num_replicas)]


def read_profile(path: str) -> dict[str, Any] | None:
    """The profile saved at ``path``, validated (None: no file there);
    ``LatencyProfileError`` names what is wrong with one that is there."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LatencyProfileError("(file)", f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise LatencyProfileError("(file)", f"{path} is not JSON: {exc}") from None
    try:
        LatencyModel.from_profile(data)
    except LatencyProfileError as exc:
        raise LatencyProfileError(exc.field, f"{path}: {str(exc).partition(': ')[2]}") from None
    return data


def check_profiles(path: str, num_replicas: int) -> None:
    """Refuse (``LatencyProfileError``) a profile that exists and is not
    valid, before anything loads; a missing one is fine (it starts fresh)."""
    for replica_path in replica_paths(path, num_replicas):
        read_profile(replica_path)


def profile_identity(engine: Any) -> dict[str, Any]:
    """What a fit was learned for: step costs learned on another model,
    batch bound, thread count or kernels would mislead admission."""
    config = engine.config
    return {
        "model": config.model,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "num_threads": config.num_threads,
        "data_parallel_size": config.data_parallel_size,
        "kernels": engine.projection_choice.summary,
    }


def seed_models(models: Sequence[LatencyModel], paths: Sequence[str], identity: dict[str, Any]) -> int:
    """Seed each of ``models`` from its profile in ``paths`` where there is
    one learned for ``identity``; returns how many were seeded."""
    seeded = 0
    for model, path in zip(models, paths, strict=True):
        data = read_profile(path)
        if data is None:
            log.info("no latency profile at %s yet: the latency model starts fresh", path)
            continue
        if data["identity"] != identity:
            log.warning(
                "the latency profile at %s was learned for %s, not %s: the latency model starts fresh",
                path,
                json.dumps(data["identity"], sort_keys=True),
                json.dumps(identity, sort_keys=True),
            )
            continue
        model.adopt(LatencyModel.from_profile(data))
        seeded += 1
        log.info("latency model seeded from %s (%d steps)", path, model.num_steps)
    return seeded


def save_models(models: Sequence[LatencyModel], paths: Sequence[str], identity: dict[str, Any]) -> None:
    """Write each of ``models`` to its path, atomically: a temporary file in
    the same folder, flushed, then renamed over the old one. A failure is
    logged, not raised: the server is stopping either way."""
    for model, path in zip(models, paths, strict=True):
        folder = os.path.dirname(os.path.abspath(path))
        temporary = None
        try:
            text = json.dumps(model.to_profile(identity), allow_nan=False, indent=1)
            with tempfile.NamedTemporaryFile(
                "w", encoding="utf-8", dir=folder, prefix=".slo-profile-", suffix=".tmp", delete=False
            ) as file:
                temporary = file.name
                file.write(text + "\n")
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except (OSError, ValueError) as exc:
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)
            log.error("cannot save the latency profile to %s: %s", path, exc)
            continue
        log.info("latency model saved to %s (%d steps)", path, model.num_steps)


def seed_engine(engine: Any, path: str) -> int:
    """Seed each of ``engine``'s replicas from its profile under ``path``."""
    models = engine.latency_models()
    return seed_models(models, replica_paths(path, len(models)), profile_identity(engine))


def save_engine(engine: Any, path: str) -> None:
    """Save each of ``engine``'s replicas' latency models under ``path``."""
    models = engine.latency_models()
    save_models(models, replica_paths(path, len(models)), profile_identity(engine))
