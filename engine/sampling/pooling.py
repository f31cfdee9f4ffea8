"""Embeddings: a request that prefills its prompt and, instead of sampling,
ends with its final hidden states (after the model's final norm) pooled
into one vector.

- ``PoolingConfig``: how the served model pools, read once from its folder:
  sentence-transformers' ``modules.json`` and ``1_Pooling/config.json``
  (last token, mean or CLS; ``2_Normalize``), else last token, normalised,
  as vLLM pools a decoder LM. ``dimensions`` (Matryoshka truncation) only
  where the model declares it: ``config.json``'s ``is_matryoshka`` or
  ``matryoshka_dimensions``, as vLLM reads them.
- ``PoolingParams``: what a caller asks (``dimensions``); ``Pooling``: a
  request's pooling once the model's config resolved it.
- ``pool_rows``: a chunk's share, from the rows the runner kept for it;
  ``PooledState``: a request's shares added up, chunk after chunk.

Mean pooling over a prompt prefilled in several chunks adds each chunk's
row sum (float64) as it comes and divides once the last chunk is in, so no
chunk's rows are kept. A mean or CLS request never reads the prefix cache:
a cached position has no hidden state. Every computation of it therefore
starts at position 0, and a chunk starting there (a recompute after a
preemption) starts the sum again.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

import attrs
import torch

from trioserve.engine.errors import InvalidRequestError, ModelLoadError


class PoolingMethod(enum.Enum):
    """Which final hidden states make the vector."""

    LAST = "last"  # the last prompt token's
    MEAN = "mean"  # the mean of every prompt token's
    CLS = "cls"  # the first prompt token's

    @property
    def needs_every_position(self) -> bool:
        """Whether positions before the last count, so a prefix-cache hit
        (which computes none of them) cannot serve the request."""
        return self is not PoolingMethod.LAST


# sentence-transformers' 1_Pooling/config.json keys, in the order they win.
_ST_MODES = {
    "pooling_mode_lasttoken": PoolingMethod.LAST,
    "pooling_mode_mean_tokens": PoolingMethod.MEAN,
    "pooling_mode_cls_token": PoolingMethod.CLS,
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def _positive_or_none(_instance: object, _attribute: object, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"dimensions must be a positive integer, got {value!r}", field="dimensions")


@attrs.frozen
class PoolingParams:
    """What an embedding request asks: ``dimensions``, the length to cut
    the vector to (Matryoshka), or None for the model's whole width."""

    dimensions: int | None = attrs.field(default=None, validator=_positive_or_none)


@attrs.frozen
class Pooling:
    """A request's pooling, as the served model's config resolved it."""

    method: PoolingMethod
    normalize: bool
    dimensions: int | None = None

    def num_rows(self, start: int, num_tokens: int, num_prompt_tokens: int) -> int:
        """How many trailing rows of a chunk at ``start`` the runner keeps:
        all of them for mean pooling; for CLS the first chunk's (row 0 is
        the one used, and the model hands out trailing rows only); for last
        token the final chunk's last."""
        if self.method is PoolingMethod.MEAN:
            return num_tokens
        if self.method is PoolingMethod.CLS:
            return num_tokens if start == 0 else 0
        return 1 if start + num_tokens == num_prompt_tokens else 0


@attrs.frozen
class PoolingConfig:
    """How the served model pools (``from_folder``), and where that came
    from (``source``, for the log)."""

    method: PoolingMethod = PoolingMethod.LAST
    normalize: bool = True
    # Matryoshka: any ``dimensions`` up to the width when True; only these
    # when a tuple; refused when False.
    matryoshka: bool | tuple[int, ...] = False
    source: str = "default (last token, normalised)"

    @classmethod
    def from_folder(cls, folder: Path | None) -> PoolingConfig:
        """The folder's sentence-transformers pooling where it has one, else
        the default; Matryoshka from its ``config.json``. Raises
        ``ModelLoadError`` naming the file for one that cannot be read."""
        config = cls()
        if folder is None:
            return config
        matryoshka = _matryoshka(folder / "config.json")
        modules = _st_modules(folder)
        if modules is None:
            return attrs.evolve(config, matryoshka=matryoshka)
        pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
        if pooling is None:
            return attrs.evolve(config, matryoshka=matryoshka)
        path = folder / str(pooling.get("path", "")) / "config.json"
        settings = _read_json(path)
        method = next((m for key, m in _ST_MODES.items() if settings.get(key)), None)
        if method is None:
            modes = [key for key, on in settings.items() if key.startswith("pooling_mode") and on]
            raise ModelLoadError(f"{path}: pooling mode {modes or 'none'} is not one of {', '.join(_ST_MODES)}")
        normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
        source = f"{path} ({method.value}{', normalised' if normalize else ''})"
        return cls(method, normalize, matryoshka, source)

    def resolve(self, params: PoolingParams, hidden_size: int) -> Pooling:
        """A request's pooling; ``InvalidRequestError`` naming ``dimensions``
        where the model does not cut its vectors, or not to that length."""
        dims = params.dimensions
        if dims is not None:
            if self.matryoshka is False:
                raise InvalidRequestError(
                    "dimensions is not supported by this model (its config declares no Matryoshka embeddings)",
                    field="dimensions",
                )
            allowed = self.matryoshka if isinstance(self.matryoshka, tuple) else None
            if dims > hidden_size or (allowed is not None and dims not in allowed):
                what = f"one of {list(allowed)}" if allowed is not None else f"at most {hidden_size}"
                raise InvalidRequestError(f"dimensions must be {what}, got {dims}", field="dimensions")
            if dims == hidden_size:
                dims = None
        return Pooling(self.method, self.normalize, dims)


def served_pooling(task: str, folder: Path | None) -> PoolingConfig | None:
    """How the model in ``folder`` pools when ``task`` (``EngineConfig.task``)
    makes it an embedding model, else None (it generates)."""
    if task == "generate" or (task == "auto" and not is_sentence_transformers(folder)):
        return None
    return PoolingConfig.from_folder(folder)


def is_sentence_transformers(folder: Path | None) -> bool:
    """Whether ``folder`` is a sentence-transformers model (its
    ``modules.json`` lists a Pooling module): served as an embedding model
    unless told otherwise."""
    modules = None if folder is None else _st_modules(folder)
    return modules is not None and any(m.get("type") == _ST_POOLING for m in modules)


def _st_modules(folder: Path) -> list[dict] | None:
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{path}: expected a list of modules")
    return modules


def _matryoshka(path: Path) -> bool | tuple[int, ...]:
    if not path.is_file():
        return False
    config = _read_json(path)
    dims = config.get("matryoshka_dimensions") if isinstance(config, dict) else None
    if dims:
        return tuple(int(d) for d in dims)
    return bool(isinstance(config, dict) and config.get("is_matryoshka"))


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


@attrs.frozen(eq=False)
class ChunkPooled:
    """A chunk's share of its request's vector: the float64 sum of the
    rows it pools (``num_rows`` of them; one for CLS and last token), for
    the chunk at ``start``. A plain CPU tensor: it pickles across a
    worker process's pipe."""

    start: int
    total: torch.Tensor
    num_rows: int


def pool_rows(pooling: Pooling, start: int, rows: torch.Tensor) -> ChunkPooled | None:
    """A chunk's share from the rows the runner kept for it
    (``Pooling.num_rows``); None when it has none to give."""
    if not rows.shape[0]:
        return None
    if pooling.method is PoolingMethod.MEAN:
        picked = rows.double().sum(dim=0)
    elif pooling.method is PoolingMethod.CLS:
        picked = rows[0].double()
    else:
        picked = rows[-1].double()
    n = rows.shape[0] if pooling.method is PoolingMethod.MEAN else 1
    return ChunkPooled(start, picked.cpu(), n)


@attrs.define
class PooledState:
    """A request's shares so far: the sum of its pooled rows and how many."""

    pooling: Pooling
    total: torch.Tensor | None = None
    num_rows: int = 0

    def add(self, share: ChunkPooled) -> None:
        """Add a chunk's share; one starting at position 0 is a new
        computation of the prompt (after a preemption) and starts over."""
        if share.start == 0 or self.total is None:
            self.total, self.num_rows = share.total.clone(), share.num_rows
            return
        self.total += share.total
        self.num_rows += share.num_rows

    def embedding(self) -> tuple[float, ...]:
        """The vector: the mean for mean pooling, cut to ``dimensions``,
        then normalised (L2) where the model says so."""
        assert self.total is not None and self.num_rows, "an embedding request finished with nothing pooled"
        vector = self.total / self.num_rows
        if self.pooling.dimensions is not None:
            vector = vector[: self.pooling.dimensions]
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return tuple(vector.float().tolist())
