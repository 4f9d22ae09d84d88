"""The one check that client-given token ids belong to the vocabulary (engine, embedding engine, connector)."""

from __future__ import annotations

import pytest

from servelm.engine.vocabulary import vocabulary_error


def test_ids_inside_the_vocabulary_pass():
    assert vocabulary_error([0, 5, 99], 100) is None
    assert vocabulary_error([], 100) is None


@pytest.mark.parametrize(
    "token_ids,bad",
    [([0, 100, 101], "100"), ([3, -1], "-1"), ([1, "7"], "'7'"), ([2.0], "2.0"), ([None], "None")],
)
def test_the_first_id_outside_is_named_with_the_vocabulary_range(token_ids, bad):
    assert vocabulary_error(token_ids, 100) == f"token id {bad} is outside the vocabulary [0, 100)"
