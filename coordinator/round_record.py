"""A round's row in the store, from open to close, and the model version it commits.

Both round lifecycles of :class:`coordinator.rounds.RoundManager` (a FedAvg/NIRA round and a Global DP round,
:mod:`coordinator.global_dp`) keep the same bookkeeping through a :class:`RoundRecord`:

1. :meth:`RoundRecord.open` writes the round row with status ``open`` (base model, selected sites, privacy mode);
   :class:`RoundRecord` itself attaches to a row that already exists (a round being closed, or recovered after a
   crash).
2. :meth:`RoundRecord.commit_model` stores the round's new model: the server optimizer's state for it first (so a
   restart from that version continues with the same state), then the model's bytes under its version hash. The
   hash and the bytes come from one safetensors encoding (:func:`shared.codec.encode_model`).
3. :meth:`RoundRecord.close` marks the row ``closed`` (naming the committed model) or ``failed``, with the number
   of updates it aggregated, its close time and an optional detail.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from shared.codec import encode_model, encode_tensors

from coordinator.optimizers.base import ServerOptimizer
from coordinator.storage import Store, dumps
from coordinator.tables import RoundRow, utcnow

__all__ = ["RoundRecord", "store_model", "save_optimizer_state"]

DETAIL_CHARS = 2000  # the longest detail a round row keeps


def save_optimizer_state(store: Store, optimizer: ServerOptimizer, model_hash: str) -> None:
    """Store ``optimizer``'s state tensors (if it has any) as a blob named in the strategy-state table under
    ``optimizer/<model_hash>``, so that a restart from that model version continues with the same state."""
    state = optimizer.state_tensors()
    if state:
        digest = store.put_blob(encode_tensors(state))
        store.set_state(f"optimizer/{model_hash}", digest)


def store_model(store: Store, weights: Mapping[str, np.ndarray], *, round: int,
                optimizer: ServerOptimizer | None = None) -> str:
    """Store ``weights`` as the model version of ``round`` and return its hash (``shared.codec.model_hash``),
    encoding them once; with ``optimizer``, its state is saved for that version first.

    Raises:
        PayloadError: a value is not a numpy array (``shared.codec.encode_tensors``).
    """
    model_hash, data = encode_model(weights)
    if optimizer is not None:
        save_optimizer_state(store, optimizer, model_hash)
    store.put_model(model_hash, data, round=round)
    return model_hash


class RoundRecord:
    """The store's row of round ``round`` (trained from ``base_model_hash``), and the model it commits.

    Constructed directly, it attaches to a row that exists; :meth:`open` writes a new one. ``new_model_hash`` is
    None until :meth:`commit_model`.
    """

    def __init__(self, store: Store, round: int, base_model_hash: str) -> None:
        self.store = store
        self.round = int(round)
        self.base_model_hash = base_model_hash
        self.new_model_hash: str | None = None

    @classmethod
    def open(cls, store: Store, *, round: int, base_model_hash: str, selected: Iterable[str],
             privacy: str) -> RoundRecord:
        """Write round ``round``'s row with status ``open`` (``selected``: the site ids offered the round, in the
        order given; ``privacy``: the federation's mode) and return its record.

        Raises:
            sqlalchemy.exc.IntegrityError: the round already has a row.
        """
        with store.session() as s:
            s.add(RoundRow(round=round, status="open", base_model_hash=base_model_hash,
                           selected_json=dumps(list(selected)), privacy=privacy))
        return cls(store, round, base_model_hash)

    @classmethod
    def attach(cls, row: RoundRow, store: Store) -> RoundRecord:
        """The record of an existing ``row`` (e.g. a round a previous process left open)."""
        return cls(store, row.round, row.base_model_hash)

    def commit_model(self, weights: Mapping[str, np.ndarray], *, optimizer: ServerOptimizer | None = None) -> str:
        """Store the round's new model (see :func:`store_model`) and return its hash; :meth:`close` with
        ``closed`` then names it."""
        self.new_model_hash = store_model(self.store, weights, round=self.round, optimizer=optimizer)
        return self.new_model_hash

    @property
    def model_hash_after(self) -> str:
        """The global model after the round: the committed one, else the base model."""
        return self.new_model_hash if self.new_model_hash is not None else self.base_model_hash

    def close(self, status: str, *, num_accepted: int | None = None, detail: str | None = None) -> None:
        """Mark the row ``status`` (``closed``: names the committed model; anything else: no new model) with its
        close time; ``num_accepted`` and ``detail`` (cut to 2000 characters) are written when given.

        Raises:
            ValueError: ``closed`` before :meth:`commit_model`.
            LookupError: the round has no row.
        """
        if status == "closed" and self.new_model_hash is None:
            raise ValueError(f"round {self.round}: close('closed') needs commit_model() first (no new model)")
        with self.store.session() as s:
            row = s.get(RoundRow, self.round)
            if row is None:
                raise LookupError(f"round {self.round} has no row to close")
            row.status = status
            row.new_model_hash = self.new_model_hash if status == "closed" else None
            if num_accepted is not None:
                row.num_accepted = num_accepted
            row.closed_at = utcnow()
            if detail is not None:
                row.detail = detail[:DETAIL_CHARS]
