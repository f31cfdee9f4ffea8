"""Numeric fields of the engine's, the pool's and the server's values reject
bad values with a ValueError naming the field (engine/validators.py)."""

import math

import pytest

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.kv_batch import KVAllocation
from trioserve.web.settings import ServerConfig

REQUIRED = [
    (EngineConfig, "block_size"),
    (EngineConfig, "max_num_seqs"),
    (EngineConfig, "max_num_batched_tokens"),
    (EngineConfig, "max_queued_requests"),
    (EngineConfig, "shutdown_timeout"),
    (ServerConfig, "shutdown_timeout"),
    (ServerConfig, "max_body_size"),
]
OPTIONAL = [
    (EngineConfig, "max_model_len"),
    (EngineConfig, "max_queued_tokens"),
    (EngineConfig, "priority_aging_steps"),
    (EngineConfig, "num_threads"),
    (ServerConfig, "max_request_time"),
]


@pytest.mark.parametrize("value", [0, -1, math.nan, "8"])
@pytest.mark.parametrize(("cls", "field"), REQUIRED + OPTIONAL)
def test_a_positive_field_rejects_a_bad_value_by_name(cls, field, value):
    with pytest.raises(ValueError, match=f"^{field} must be > 0, got {value!r}$"):
        cls(**{field: value})


@pytest.mark.parametrize(("cls", "field"), REQUIRED)
def test_a_required_positive_field_rejects_none(cls, field):
    with pytest.raises(ValueError, match=f"^{field} must be > 0, got None$"):
        cls(**{field: None})


@pytest.mark.parametrize(("cls", "field"), OPTIONAL)
def test_an_optional_positive_field_takes_none_or_a_positive_number(cls, field):
    assert getattr(cls(**{field: None}), field) is None
    assert getattr(cls(**{field: 3}), field) == 3


def test_the_pool_and_its_messages_check_their_counts():
    with pytest.raises(ValueError, match="^num_blocks must be > 0, got 0$"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="^block_size must be > 0, got -4$"):
        BlockManager(8, -4)
    with pytest.raises(ValueError, match="^num_computed_tokens must be >= 0, got -1$"):
        KVAllocation("a", -1, 1)
    with pytest.raises(ValueError, match="^num_new_tokens must be > 0, got 0$"):
        KVAllocation("a", 0, 0)
    assert KVAllocation("a", 0, 1).num_computed_tokens == 0


@pytest.mark.parametrize("value", [0, -3, 2.5, True, None, "8"])
def test_max_buffered_outputs_must_be_an_integer_of_at_least_one(value):
    with pytest.raises(ValueError, match=f"^max_buffered_outputs must be an integer >= 1, got {value!r}$"):
        EngineConfig(max_buffered_outputs=value)
    assert EngineConfig(max_buffered_outputs=1).max_buffered_outputs == 1
